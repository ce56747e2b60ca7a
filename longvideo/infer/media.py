"""The video a request names: a data: URL, a file under --media-dir, or (with
--allow-remote-media) an http(s) URL fetched so that it cannot reach the server's own network:
every hop's host is checked against --allowed-media-domains, resolved once, every address it
resolves to must be public, and the connection goes to the checked address (never resolved again);
redirects are followed by hand, each one checked the same way; one deadline and one size cap cover
the whole download (docs/security.md, "Server"; docs/serving.md).

Errors say what was refused and why without echoing internal detail (no resolved address, no
errno text); `FetchError.detail` carries that for the server's log.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from longvideo.infer.api import ApiError

MAX_REDIRECTS = 5
CHUNK = 1 << 16

Resolver = Callable[[str, int], list[str]]
"""host, port -> the addresses to try (strings), as the system resolver gives them."""


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


@dataclass(frozen=True)
class MediaPolicy:
    max_bytes: int
    """Largest video accepted (413 above it)."""
    media_dir: Path | None = None
    """file:// URLs are read from inside it only (403 otherwise, and without it)."""
    allow_remote: bool = False
    """http(s) URLs are fetched only when set (403 otherwise)."""
    allowed_domains: tuple[str, ...] = ()
    """HOST or HOST:PORT entries a remote URL's host must match (empty: any public host). An entry
    that is an IP address literal also permits that address when it is not public (an operator's
    explicit choice, e.g. `127.0.0.1:8080` for a local media server); a host name never does."""
    timeout_s: float = 30.0
    """One deadline for the whole download, redirects included."""
    resolver: Resolver = system_resolver


class FetchError(ApiError):
    """A refused or failed download; `detail` (for the log only) says what exactly happened."""

    def __init__(self, status: int, message: str, param: str, detail: str = ""):
        super().__init__(status, message, param)
        self.detail = detail


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, Teredo, NAT64): where it goes."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in ipaddress.ip_network("64:ff9b::/96") or ip in ipaddress.ip_network("64:ff9b:1::/48"):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(address: str) -> bool:
    """Whether an address is a public unicast one: not loopback, private, link-local (cloud
    metadata at 169.254.169.254 included), shared (100.64/10), unique-local (fd00:ec2::254
    included), multicast, reserved, unspecified or documentation, nor an IPv6 address carrying
    such an IPv4 one."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    inner = _embedded_v4(ip) if isinstance(ip, ipaddress.IPv6Address) else None
    if inner is not None:  # where it goes is the IPv4 address it carries
        return is_public(str(inner))
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)


def _literal(host: str) -> str | None:
    """The canonical form of an IP address literal, else None."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    """Lower case, no brackets, no trailing dot."""
    port: int
    path: str
    """Path and query, as sent in the request line."""


def _target(url: str, where: str) -> _Target:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise FetchError(400, "the URL cannot be parsed", where) from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise FetchError(403, "only http and https URLs are fetched", where, url[:200])
    if parts.username is not None or parts.password is not None:
        raise FetchError(400, "a URL with credentials is refused", where)
    host = (parts.hostname or "").rstrip(".").lower()
    if not host:
        raise FetchError(400, "the URL has no host", where)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(scheme, host, port or (443 if scheme == "https" else 80), path)


def _allowed(t: _Target, policy: MediaPolicy) -> tuple[bool, bool]:
    """(the host matches --allowed-media-domains or the list is empty, the matching entry is an IP
    literal that permits a non-public address)."""
    if not policy.allowed_domains:
        return True, False
    for entry in policy.allowed_domains:
        host, port = _split_entry(entry)
        literal = _literal(host)
        if (literal or host) == (_literal(t.host) or t.host) and port in (None, t.port):
            return True, literal is not None
    return False, False


def _split_entry(entry: str) -> tuple[str, int | None]:
    """'host', 'host:port', '[v6]:port', 'v6' -> (host, port or None)."""
    e = entry.strip().rstrip(".").lower()
    if e.startswith("["):
        host, _, rest = e[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    if e.count(":") == 1:
        host, port = e.split(":")
        return host, int(port)
    return e, None


def check_domains(entries: tuple[str, ...]) -> None:
    """ValueError naming the entry when one of --allowed-media-domains cannot be read."""
    for entry in entries:
        try:
            host, port = _split_entry(entry)
        except ValueError:
            raise ValueError(
                f"--allowed-media-domains: {entry!r} is not HOST or HOST:PORT"
            ) from None
        if not host or (port is not None and not 0 < port < 65536):
            raise ValueError(f"--allowed-media-domains: {entry!r} is not HOST or HOST:PORT")


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to `address` (checked), with the URL's host in the Host header."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = self.pinned = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """As _PinnedHTTP, over TLS verified for the URL's host name."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self.pinned = self._context.wrap_socket(sock, server_hostname=self.host)


def _too_big(n: int, policy: MediaPolicy, where: str) -> FetchError:
    return FetchError(
        413,
        f"the video is {n / 2**20:.1f} MiB, over the server's limit of "
        f"{policy.max_bytes / 2**20:.1f} MiB (--max-upload-mb)",
        where,
    )


def fetch_remote(
    url: str, where: str, policy: MediaPolicy, cancelled: Callable[[], bool] = lambda: False
) -> bytes:
    """The bytes at an http(s) URL within the policy (see the module's docstring); FetchError
    otherwise. `cancelled` is asked between reads: True stops the download (FetchError 499)."""
    if not policy.allow_remote:
        raise FetchError(
            403, "remote media are refused: start the server with --allow-remote-media", where
        )
    deadline = time.monotonic() + policy.timeout_s
    for hop in range(MAX_REDIRECTS + 1):
        t = _target(url, where)
        ok, explicit = _allowed(t, policy)
        hop_name = "a redirect's URL" if hop else "the URL"
        if not ok:
            raise FetchError(
                403, f"{hop_name} names a host that is not in --allowed-media-domains", where, url
            )
        try:
            addresses = policy.resolver(t.host, t.port)
        except (OSError, UnicodeError) as e:
            raise FetchError(400, f"{hop_name}'s host cannot be resolved", where, repr(e)) from None
        bad = [a for a in addresses if not is_public(a)]
        if not addresses or (bad and not explicit):
            raise FetchError(
                403,
                f"{hop_name}'s host resolves to an address that is not public (loopback, "
                "private, link-local, metadata, multicast or reserved): refused",
                where,
                f"{t.host} -> {addresses}",
            )
        status, location, data = _get(t, addresses[0], deadline, policy, where, cancelled)
        if status in (301, 302, 303, 307, 308):
            if not location:
                raise FetchError(400, "the media server redirected without a Location", where)
            url = urllib.parse.urljoin(f"{t.scheme}://{t.host}:{t.port}{t.path}", location)
            continue
        if status != 200:
            raise FetchError(400, f"the media server answered HTTP {status}", where)
        return data
    raise FetchError(400, f"more than {MAX_REDIRECTS} redirects", where)


def _get(t: _Target, address: str, deadline: float, policy, where, cancelled):
    """One GET to the checked address: (status, Location, body); the body is read only for 200."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise FetchError(504, f"the download took longer than {policy.timeout_s:g} s", where)
    cls = _PinnedHTTPS if t.scheme == "https" else _PinnedHTTP
    conn = cls(t.host, t.port, address, timeout=min(left, 10.0))
    try:
        conn.request("GET", t.path, headers={"User-Agent": "longvideo-serve", "Accept": "*/*"})
        r = conn.getresponse()
        if r.status != 200:
            return r.status, r.getheader("Location"), b""
        size = r.getheader("Content-Length")
        if size is not None and size.isdigit() and int(size) > policy.max_bytes:
            raise _too_big(int(size), policy, where)
        out = bytearray()
        while chunk := r.read1(CHUNK):
            out += chunk
            if len(out) > policy.max_bytes:
                raise _too_big(len(out), policy, where)
            if cancelled():
                raise FetchError(499, "the client went away", where)
            left = deadline - time.monotonic()
            if left <= 0:
                raise FetchError(
                    504, f"the download took longer than {policy.timeout_s:g} s", where
                )
            conn.pinned.settimeout(min(left, 10.0))  # conn.sock may be handed to the response
        return 200, None, bytes(out)
    except FetchError:
        raise
    except (OSError, http.client.HTTPException, ssl.SSLError) as e:
        timeout = isinstance(e, (socket.timeout, TimeoutError))
        late = timeout and time.monotonic() >= deadline  # the socket's wait ended at the deadline
        raise FetchError(
            504 if timeout else 400,
            f"the download took longer than {policy.timeout_s:g} s"
            if late
            else "the media server did not answer in time"
            if timeout
            else "the download failed",
            where,
            f"{t.host} ({address}): {e!r}",
        ) from None
    finally:
        conn.close()


IMAGES = {b"\x89PNG": "a PNG image", b"\xff\xd8\xff": "a JPEG image", b"BM": "a BMP image"}
"""Still images FFmpeg would read as one-frame videos: refused (an animated GIF is a video)."""


def load_video(
    url: str, where: str, policy: MediaPolicy, cancelled: Callable[[], bool] = lambda: False
) -> bytes:
    """The bytes of the video at `url` within the policy; ApiError otherwise."""
    data = _fetch(url, where, policy, cancelled)
    kind = next((k for magic, k in IMAGES.items() if data.startswith(magic)), None)
    kind = kind or ("a WebP image" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else None)
    if kind is not None:
        raise ApiError(400, f"this is {kind}, not a video", where)
    return data


def _fetch(url: str, where: str, policy: MediaPolicy, cancelled) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        head, _, payload = url.partition(",")
        if not head.lower().endswith(";base64"):
            raise ApiError(400, "a data URL must be data:video/...;base64,...", where)
        if not head[5:].lower().startswith("video/"):
            raise ApiError(
                400, f"a data URL must hold a video, not {head[5:].split(';')[0][:50]!r}", where
            )
        if len(payload) * 3 // 4 > policy.max_bytes:
            raise _too_big(len(payload) * 3 // 4, policy, where)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ApiError(400, f"the data URL is not valid base64: {e}", where) from None
    if scheme == "file":
        return _local(url, where, policy)
    if scheme in ("http", "https"):
        return fetch_remote(url, where, policy, cancelled)
    raise ApiError(
        400, "must be a data:video/...;base64, URL, a file:// path or an http(s) URL", where
    )


def _local(url: str, where: str, policy: MediaPolicy) -> bytes:
    if policy.media_dir is None:
        raise ApiError(
            403, "file:// URLs are refused: the server was started without --media-dir", where
        )
    rest = url[5:].split("?", 1)[0].split("#", 1)[0]
    rest = rest[2:] if rest.startswith("//") else rest  # file:///abs, file://rel
    path = Path(urllib.parse.unquote(rest))
    root = policy.media_dir.resolve()
    full = (root / path).resolve()  # an absolute path replaces the root
    if ".." in path.parts or not full.is_relative_to(root):
        raise ApiError(
            403,
            "a file:// path may not contain '..'"
            if ".." in path.parts
            else "the file is outside --media-dir",
            where,
        )
    if not full.is_file():
        raise ApiError(404, "no such file in --media-dir", where)
    if full.stat().st_size > policy.max_bytes:
        raise _too_big(full.stat().st_size, policy, where)
    return full.read_bytes()
