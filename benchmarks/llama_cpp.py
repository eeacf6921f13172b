"""What llama.cpp's benchmark tools print, read back: one parser for every script that runs them
(no torch import, so `headline_table.py`, which only drives other processes, stays light)."""

from __future__ import annotations

import json


def llama_records(text: str) -> list[dict]:
    """The result records in a llama.cpp tool's output: llama-bench's `-o json` list (also one cut
    short where a run failed), llama-batched-bench's JSON lines, among log lines."""
    decoder, records, at = json.JSONDecoder(), [], text.find("{")
    while at != -1:
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError:
            end = at + 1
        else:
            if isinstance(value, dict) and ("avg_ts" in value or "speed_tg" in value):
                records.append(value)
        at = text.find("{", end)
    return records
