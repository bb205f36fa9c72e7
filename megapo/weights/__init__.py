"""Model weights between HF tensors and the sharded learner: loading HF safetensors into it (hf_load.py) and
weight sync learner -> engines: streaming gather (gather.py), buckets (buckets.py), transports
(transports.py: tensor, disk; broadcast.py) and the entry point `sync_learner` (sync.py)."""

from megapo.weights.buckets import bucket_bytes
from megapo.weights.sync import SyncStats, sync_named, sync_learner
from megapo.weights.transports import DiskTransport, TensorTransport, Transport

__all__ = ["bucket_bytes", "SyncStats", "sync_named", "sync_learner", "DiskTransport", "TensorTransport", "Transport"]
