//! KV transfers between prefill and decode: the manifest and its fail-closed checks (issue 3).
