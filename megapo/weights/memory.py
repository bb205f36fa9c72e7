"""Peak bytes of tensors allocated while a function runs, from torch's own allocator accounting (its
profiler's allocation events): the measure behind "a sync holds about one bucket of extra memory".
CPU allocations of the calling thread and of threads the profiler sees; slow, for tests and benchmarks."""

from __future__ import annotations

from collections.abc import Callable


def allocator_peak(fn: Callable[[], object]) -> tuple[int, object]:
    """(peak bytes alive above the starting point while fn() ran, fn's result)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0].name == "Allocation":
            events.append((node.start_time_ns, node.typed[1].alloc_size))
        stack.extend(node.children)
    peak = alive = 0
    for _, size in sorted(events):
        alive += size
        peak = max(peak, alive)
    return peak, result
