"""Ranks that fail together: the helpers live in longvideo.distributed (the one home of what ranks
do together); this name is kept for existing imports."""

from longvideo.distributed import RankFailedError, comm_device, fail_together, together

__all__ = ["RankFailedError", "comm_device", "fail_together", "together"]
