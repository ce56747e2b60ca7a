"""An lmms-eval model (entry point `lmms_eval.models`: `manifest`) asking requests as `eval mcq` asks;
``loglikelihood`` returns its pair in a ``GenerationResult`` (docs/evaluation.md, "lmms-eval").
"""

from __future__ import annotations

from dataclasses import replace

from lmms_eval.api.instance import GenerationResult
from lmms_eval.api.model import lmms

from longvideo.infer.chat import ChatSession, infer_config, load_model
from longvideo.infer.mcq import fit_and_encode


def manifest():
    """The entry point lmms-eval loads: model id ``longvideo`` -> LongVideoLMM."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(
        model_id="longvideo", simple_class_path="longvideo.infer.lmms.LongVideoLMM"
    )


class LongVideoLMM(lmms):
    """model_args: pretrained (a model directory), device, fps, max_frames, max_new_tokens."""

    def __init__(
        self,
        pretrained: str,
        device: str | None = "cpu",
        fps=1.0,
        max_frames=None,
        max_new_tokens=16,
        **unused,
    ):
        super().__init__()
        self.pre = load_model(pretrained, device or "cpu")
        self.fps, self.max_frames = (
            float(fps),
            None if max_frames in (None, "", "None") else int(max_frames),
        )
        self.infer = infer_config(self.pre, max_new_tokens=int(max_new_tokens), temperature=0.0)

    def _doc(self, req):
        _, _, visual, doc_id, task, split = req.args
        return self.task_dict[task][split][doc_id], visual

    def _grouped(self, requests, room):
        """(index, session) of every request, one session per video (encoded and prefilled once)."""
        by_video: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            doc, visual = self._doc(req)
            paths = visual(doc)
            if len(paths) != 1 or not isinstance(paths[0], str):
                raise ValueError(
                    f"longvideo answers about one video a request (a path), got {paths!r}"
                )
            by_video.setdefault(paths[0], []).append(i)
        for path, idx in by_video.items():
            enc = fit_and_encode(
                self.pre,
                path,
                [requests[i].args[0] for i in idx],
                max(room(requests[i]) for i in idx),
                self.fps,
                self.max_frames,
                self.infer.encode_batch_frames,
            )
            session = ChatSession(self.pre, enc, infer=self.infer)
            for i in idx:
                yield i, session

    def _continuation(self, req) -> list[int]:
        cont = req.args[1]
        return self.pre.tokenizer.encode(cont if isinstance(cont, str) else cont(self._doc(req)[0]))

    def loglikelihood(self, requests):
        out = [None] * len(requests)
        for i, session in self._grouped(requests, lambda r: len(self._continuation(r))):
            ((logp, _, greedy),) = session.score(
                requests[i].args[0], [self._continuation(requests[i])]
            )
            out[i] = GenerationResult(text=(-logp, greedy))
        return out

    def generate_until(self, requests):
        out = [""] * len(requests)
        n_new = lambda r: int(r.args[1].get("max_new_tokens") or self.infer.max_new_tokens)  # noqa: E731
        for i, session in self._grouped(requests, n_new):
            session.infer = replace(self.infer, max_new_tokens=n_new(requests[i]))
            text = session.ask(requests[i].args[0])
            until = requests[i].args[1].get("until") or []
            for stop in [until] if isinstance(until, str) else until:
                text = text.split(stop)[0]
            out[i] = text
        return out

    def generate_until_multi_round(self, requests):
        raise NotImplementedError(
            "longvideo answers single-round requests (loglikelihood, generate_until)"
        )
