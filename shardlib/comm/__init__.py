"""Communication, lesson 01: collectives from scratch, the ledger of bytes sent, the alpha-beta cost.

    ring.py       ring all-reduce, reduce-scatter, all-gather and broadcast on send/recv
    ops.py        torch.distributed's calls, recorded: what every technique communicates with
    ledger.py     comm_ledger(): the calls and bytes of one rank (PyTorch's own calls: record_torch=True)
    cost.py       the alpha-beta model and the bytes each rank sends
    quantized.py  8-bit all-gather and reduce-scatter, as ZeRO++ does (lesson 13)
"""

from shardlib.comm import ops
from shardlib.comm.cost import AlphaBeta, fit_alpha_beta, ring_sent_bytes
from shardlib.comm.ledger import CommLedger, CommRecord, comm_ledger, group_ranks
from shardlib.comm.ring import ring_all_gather, ring_all_reduce, ring_broadcast, ring_reduce_scatter

__all__ = ["ops", "AlphaBeta", "fit_alpha_beta", "ring_sent_bytes", "CommLedger", "CommRecord", "comm_ledger",
           "group_ranks", "ring_all_gather", "ring_all_reduce", "ring_broadcast", "ring_reduce_scatter"]
