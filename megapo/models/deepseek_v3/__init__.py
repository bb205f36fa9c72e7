"""DeepSeek-V3 (also Kimi-K2 / Moonlight configs): MLA, sigmoid router with expert bias and group-limited
top-k, routed scaling factor, shared experts, first k layers dense."""
