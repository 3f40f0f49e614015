"""Worker groups: tensor and pipeline parallel ranks of one worker, on one machine or several (see ranks.py)."""
