"""Warm start: knowing which experts matter before (or instead of) learning it the slow way.

discovery.py  router-only pass over a warm-up prompt that seeds the bank's first fill
profile.py    per-layer expert frequencies recorded on real prompts: pins and seeds
trace.py      routing traces (expert ids per token and layer), recorded for replay
prepack.py    snapshots of a warmed bank, loaded at the next start
"""
