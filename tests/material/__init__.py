"""Test material made on the spot: real encodes (corpus), camera moves over photographs (photo_videos)."""
