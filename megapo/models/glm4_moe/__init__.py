"""GLM-4.5 / GLM-4.6 (glm4_moe): GQA attention with q/k/v biases, partial rotary (the first half of each head
by default), optional q/k RMSNorm, and the DeepSeekMoE block (sigmoid router with expert bias and optional
group-limited top-k, routed scaling factor, shared experts, first k layers dense)."""
