"""longvideo: long-context video-language models with ring attention."""

__version__ = "0.1.0"
