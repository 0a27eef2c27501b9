"""The compressors compared, and what "keeps the accuracy" means."""
from __future__ import annotations


COMPRESSORS = [
    ("none (float32 ring)", "none", {}),
    ("fp16", "fp16", {"error_feedback": True}),
    ("bf16", "bf16", {"error_feedback": True}),
    ("qsgd 4-bit", "qsgd", {"levels": 7, "error_feedback": True}),
    ("sign (1-bit)", "sign", {}),
    ("powersgd r4", "powersgd", {"rank": 4}),
    ("topk 1%", "topk", {"ratio": 0.01}),
    ("topk 10%", "topk", {"ratio": 0.1}),
    ("randomk 10%", "randomk", {"ratio": 0.1}),
]
WITHIN = 0.01                      # "keeps the accuracy": at most 1 point below uncompressed
QUICK = ("none (float32 ring)", "fp16", "qsgd 4-bit", "sign (1-bit)", "topk 1%")
