"""A sliding-window bug injected into vLLM's own manager, shared by the V1 (``test_hybrid.py``)
and V2 (``v2/test_v2_hybrid.py``) hybrid tests. Imports vLLM only when called, so either runner's
settings are in place first."""

from __future__ import annotations

from typing import Any


def early_window_drop(monkeypatch: Any, victim: str, window: int) -> dict:
    """Makes vLLM's sliding window (of ``window`` tokens) drop one block too many of
    ``victim``'s, once, while the block is still inside the window (an off-by-one-block in
    ``remove_skipped_blocks``): vLLM frees it and may hand it out again while the victim's row
    still names it (V2's gather nulls only what is before the window) and attention reads it.
    Returns the trigger state (``fired``: the dropped block)."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    original = SlidingWindowManager.remove_skipped_blocks
    armed: dict = {"once": True}

    def early(self, request_id, processed, num_prompt_tokens=None):
        if request_id == victim and armed.get("once") and processed >= window + 2 * self.block_size:
            armed.pop("once")
            blocks = self.req_to_blocks[request_id]
            first_read = (processed - window + 1) // self.block_size
            armed["fired"] = blocks[first_read].block_id
            return original(self, request_id, processed + self.block_size, num_prompt_tokens)
        return original(self, request_id, processed, num_prompt_tokens)

    monkeypatch.setattr(SlidingWindowManager, "remove_skipped_blocks", early)
    return armed
