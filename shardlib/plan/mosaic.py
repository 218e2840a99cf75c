"""MosaicML's benchmarks of MPT models trained with PyTorch FSDP in Composer: another engine than the
Megatron-class code the planner's constants are fitted on, held out and shown apart (validate.report), and the
runs that fit the one figure of this engine the planner needs of its own, its attention kernel's speed.

Source: mosaicml/llm-foundry, scripts/train/benchmarking/README.md (commit 4952183, 2024-04-22), its four bf16
tables: "H100 80GB BF16 (Large Scale, >= 128 GPUs)", "H100 80GB BF16", "A100 80GB" and "A100 40GB", the A100
ones "with 1600 Gbps node-node interconnect (RoCE)" between nodes of 8; for the H100s the planner's DGX H100 links
are assumed (the tables do not name them). Each row (MOSAIC_RUNS): model, sequence length, GPUs, micro-batch,
gradient accumulation, global batch, tokens/s per GPU, activation checkpointing (full recomputation), mixed
precision (DEFAULT: gradients reduced in fp32; PURE: in bf16), FSDP's sharding strategy (FULL_SHARD: ZeRO-3;
SHARD_GRAD_OP: ZeRO-2) and NumParams; step = batch s / (N tokens/s). The sizes are those of the repository's
scripts/train/yamls/pretrain/mpt-*.yaml with MPT's defaults (MPT_SIZES), checked against every row's NumParams.

fsdp_runs()           every row at 2,048 tokens, 88 runs of 125M to 70B parameters on 8 to 512 GPUs: held out,
                      never used to fit a constant.
fsdp_training_runs()  every row at another length, 512 to 65,536 tokens (121 runs): the only constant they fit is
                      how fast this engine's attention kernel runs (fitted.ATTENTION_TRITON, validate.fit_attention).
Both also give validate.checkpointing_pairs() its runs with and without activation checkpointing: compared, not fitted.

What the rows ran, from the scripts committed with them (llm-foundry's git history):
- Attention: MPT's attn_impl "triton", the default of submit_benchmarks.py (--attn_impl), FlashAttention's Triton
  kernel (attention="flash-triton"); but the large-scale H100 table's sweep.py (5e85bd62d, 2024-01-06, the commit
  that added the table) passes --attn_impl flash for the 1b, 3b, 7b and 70b rows and installs flash-attn 2.4.2
  (".[gpu-flash2]"): FlashAttention-2, attention="flash" (FLASH_ROWS).
- Recomputation: Composer's FSDP wraps each MPTBlock in PyTorch's non-reentrant checkpoint
  (activation_checkpointing_reentrant: false). The rows in mixed precision DEFAULT were measured with PyTorch 2.1.0
  (b2a43a147, 2023-10-19: sweep.sh's image mosaicml/pytorch:2.1.0_cu121 and llm-foundry v0.3.0; 5e85bd62d:
  setup.py's torch>=2.1,<2.1.1), whose checkpoint stops recomputing at a block's last saved tensor, before the MLP's
  down projection (pytorch/pytorch#96866; checkpoint_early_stop). The PURE rows are the earlier ones, measured with
  PyTorch 1.13.1 (the sweep.sh image b2a43a147 replaced; the README's "TODO: Update tables with torch 2.0"),
  whose checkpoint recomputes the whole block.
"""

from __future__ import annotations

from shardlib.plan.inputs import Cluster, Layout
from shardlib.plan.model import ModelSpec
from shardlib.plan.published import SOFTWARE, PublishedRun

# (table, MPT size, sequence length, GPUs, micro-batch, gradient accumulation, batch, tokens/s per GPU, activation
# checkpointing, mixed precision PURE, ZeRO stage of the sharding strategy, NumParams), in the tables' order
MOSAIC_RUNS = (
    # H100 80GB BF16 (Large Scale, >= 128 GPUs)
    ("h100-80gb-large", "70b", 2048, 512, 8, 1, 4096, 1007, True, False, 3, 64862437376),
    ("h100-80gb-large", "70b", 2048, 256, 8, 1, 2048, 1035, True, False, 3, 64862437376),
    ("h100-80gb-large", "70b", 2048, 128, 8, 1, 1024, 1058, True, False, 3, 64862437376),
    ("h100-80gb-large", "30b", 2048, 512, 8, 1, 4096, 2115, True, False, 3, 29975214080),
    ("h100-80gb-large", "30b", 2048, 256, 8, 1, 2048, 2148, True, False, 3, 29975214080),
    ("h100-80gb-large", "30b", 2048, 128, 8, 1, 1024, 2199, True, False, 3, 29975214080),
    ("h100-80gb-large", "13b", 2048, 512, 16, 1, 8192, 4952, True, False, 3, 12853954560),
    ("h100-80gb-large", "13b", 2048, 256, 16, 1, 4096, 4989, True, False, 3, 12853954560),
    ("h100-80gb-large", "13b", 2048, 128, 16, 1, 2048, 5080, True, False, 3, 12853954560),
    ("h100-80gb-large", "7b", 2048, 512, 6, 1, 3072, 9670, False, False, 3, 6658859008),
    ("h100-80gb-large", "7b", 2048, 256, 6, 1, 1536, 10119, False, False, 3, 6658859008),
    ("h100-80gb-large", "7b", 2048, 128, 6, 1, 768, 10475, False, False, 3, 6658859008),
    ("h100-80gb-large", "3b", 2048, 512, 8, 1, 4096, 21664, False, False, 2, 2651837440),
    ("h100-80gb-large", "3b", 2048, 256, 8, 1, 2048, 22772, False, False, 2, 2651837440),
    ("h100-80gb-large", "3b", 2048, 128, 8, 1, 1024, 23422, False, False, 2, 2651837440),
    ("h100-80gb-large", "1b", 2048, 512, 12, 1, 6144, 39837, False, False, 2, 1315950592),
    ("h100-80gb-large", "1b", 2048, 256, 12, 1, 3072, 42555, False, False, 2, 1315950592),
    ("h100-80gb-large", "1b", 2048, 128, 12, 1, 1536, 44123, False, False, 2, 1315950592),
    # H100 80GB BF16
    ("h100-80gb", "70b", 2048, 64, 8, 4, 2048, 1039, True, False, 3, 64862437376),
    ("h100-80gb", "70b", 2048, 32, 2, 16, 1024, 882, True, False, 3, 64862437376),
    ("h100-80gb", "30b", 8192, 8, 1, 21, 168, 1384, True, False, 3, 30019254272),
    ("h100-80gb", "30b", 4096, 8, 1, 21, 168, 1802, True, False, 3, 29989894144),
    ("h100-80gb", "30b", 2048, 32, 14, 3, 1344, 2308, True, False, 3, 29975214080),
    ("h100-80gb", "30b", 2048, 16, 10, 3, 480, 2263, True, False, 3, 29975214080),
    ("h100-80gb", "30b", 2048, 8, 3, 21, 504, 2002, True, False, 3, 29975214080),
    ("h100-80gb", "30b", 1024, 8, 6, 21, 1008, 2084, True, False, 3, 29967874048),
    ("h100-80gb", "13b", 32768, 8, 1, 3, 24, 1976, True, False, 3, 13011240960),
    ("h100-80gb", "13b", 16384, 8, 3, 3, 72, 2985, True, False, 3, 12927354880),
    ("h100-80gb", "13b", 4096, 8, 10, 3, 240, 4717, True, False, 3, 12864440320),
    ("h100-80gb", "13b", 2048, 64, 2, 1, 128, 4800, False, False, 3, 12853954560),
    ("h100-80gb", "13b", 2048, 32, 2, 1, 64, 4811, False, False, 3, 12853954560),
    ("h100-80gb", "13b", 2048, 16, 2, 1, 32, 4767, False, False, 3, 12853954560),
    ("h100-80gb", "13b", 2048, 8, 2, 1, 16, 4792, False, False, 3, 12853954560),
    ("h100-80gb", "13b", 1024, 8, 40, 3, 960, 5502, True, False, 3, 12848711680),
    ("h100-80gb", "7b", 65536, 8, 1, 2, 16, 1956, True, False, 3, 6918905856),
    ("h100-80gb", "7b", 32768, 8, 2, 2, 32, 3318, True, False, 3, 6784688128),
    ("h100-80gb", "7b", 8192, 8, 8, 2, 128, 6935, True, False, 3, 6684024832),
    ("h100-80gb", "7b", 4096, 8, 16, 2, 256, 8611, True, False, 3, 6667247616),
    ("h100-80gb", "7b", 2048, 8, 6, 1, 48, 10643, False, False, 3, 6658859008),
    ("h100-80gb", "7b", 1024, 8, 64, 2, 1024, 10203, True, False, 3, 6654664704),
    ("h100-80gb", "3b", 65536, 8, 1, 2, 16, 3262, True, False, 3, 2814366720),
    ("h100-80gb", "3b", 32768, 8, 3, 6, 144, 5873, True, False, 3, 2730480640),
    ("h100-80gb", "3b", 16384, 8, 1, 6, 48, 11152, False, False, 3, 2688537600),
    ("h100-80gb", "3b", 8192, 8, 3, 6, 144, 16578, False, False, 3, 2667566080),
    ("h100-80gb", "3b", 4096, 8, 5, 6, 240, 20964, False, False, 3, 2657080320),
    ("h100-80gb", "3b", 2048, 64, 6, 3, 1152, 22525, False, False, 3, 2651837440),
    ("h100-80gb", "3b", 2048, 32, 6, 3, 576, 23021, False, False, 3, 2651837440),
    ("h100-80gb", "3b", 2048, 16, 10, 3, 480, 24142, False, False, 3, 2651837440),
    ("h100-80gb", "3b", 1024, 8, 20, 6, 960, 27046, False, False, 3, 2649216000),
    ("h100-80gb", "3b", 512, 8, 40, 6, 1920, 27965, False, False, 3, 2647905280),
    ("h100-80gb", "1b", 65536, 8, 1, 2, 16, 5506, True, False, 3, 1445974016),
    ("h100-80gb", "1b", 32768, 8, 1, 4, 32, 12025, False, False, 3, 1378865152),
    ("h100-80gb", "1b", 16384, 8, 2, 4, 64, 19649, False, False, 3, 1345310720),
    ("h100-80gb", "1b", 8192, 8, 3, 4, 96, 29157, False, False, 3, 1328533504),
    ("h100-80gb", "1b", 4096, 8, 7, 4, 224, 38535, False, False, 3, 1320144896),
    ("h100-80gb", "1b", 2048, 64, 20, 1, 1280, 44402, False, False, 3, 1315950592),
    ("h100-80gb", "1b", 2048, 32, 20, 1, 640, 45130, False, False, 3, 1315950592),
    ("h100-80gb", "1b", 2048, 16, 20, 1, 320, 46037, False, False, 3, 1315950592),
    ("h100-80gb", "1b", 2048, 8, 14, 1, 112, 45455, False, False, 3, 1315950592),
    ("h100-80gb", "1b", 1024, 8, 18, 4, 576, 48910, False, False, 3, 1313853440),
    ("h100-80gb", "1b", 512, 8, 56, 4, 1792, 52275, False, False, 3, 1312804864),
    ("h100-80gb", "760m", 32768, 8, 1, 2, 16, 16291, False, False, 3, 807656448),
    ("h100-80gb", "760m", 16384, 8, 3, 2, 48, 27815, False, False, 3, 782490624),
    ("h100-80gb", "760m", 8192, 8, 6, 2, 96, 41825, False, False, 3, 769907712),
    ("h100-80gb", "760m", 4096, 8, 12, 2, 192, 55459, False, False, 3, 763616256),
    ("h100-80gb", "760m", 2048, 32, 24, 1, 768, 67971, False, False, 3, 760470528),
    ("h100-80gb", "760m", 2048, 16, 24, 1, 384, 68551, False, False, 3, 760470528),
    ("h100-80gb", "760m", 2048, 8, 24, 2, 384, 63147, False, False, 3, 760470528),
    ("h100-80gb", "760m", 1024, 8, 48, 2, 768, 78581, False, False, 3, 758897664),
    ("h100-80gb", "760m", 512, 8, 96, 2, 1536, 83749, False, False, 3, 758111232),
    # A100 80GB with 1600 Gbps node-node interconnect (RoCE)
    ("a100-80gb", "70b", 2048, 64, 8, 4, 2048, 410, True, True, 3, 64862437376),
    ("a100-80gb", "70b", 2048, 32, 2, 16, 1024, 373, True, True, 3, 64862437376),
    ("a100-80gb", "30b", 8192, 8, 1, 21, 168, 574, True, False, 3, 30019254272),
    ("a100-80gb", "30b", 4096, 8, 1, 21, 168, 814, True, False, 3, 29989894144),
    ("a100-80gb", "30b", 2048, 8, 3, 21, 504, 916, True, False, 3, 29975214080),
    ("a100-80gb", "30b", 1024, 8, 6, 21, 1008, 946, True, False, 3, 29967874048),
    ("a100-80gb", "30b", 512, 8, 12, 21, 2016, 967, True, False, 3, 29964204032),
    ("a100-80gb", "13b", 32768, 8, 1, 3, 24, 1016, True, False, 3, 13011240960),
    ("a100-80gb", "13b", 16384, 8, 3, 3, 72, 1431, True, False, 3, 12927354880),
    ("a100-80gb", "13b", 8192, 8, 5, 3, 120, 1795, True, False, 3, 12885411840),
    ("a100-80gb", "13b", 4096, 8, 10, 3, 240, 2060, True, False, 3, 12864440320),
    ("a100-80gb", "13b", 2048, 8, 2, 3, 48, 2262, False, False, 3, 12853954560),
    ("a100-80gb", "13b", 1024, 8, 40, 3, 960, 2330, True, False, 3, 12848711680),
    ("a100-80gb", "7b", 65536, 8, 1, 2, 16, 1013, True, False, 3, 6918905856),
    ("a100-80gb", "7b", 32768, 8, 2, 2, 32, 1672, True, False, 3, 6784688128),
    ("a100-80gb", "7b", 16384, 8, 4, 2, 64, 2453, True, False, 3, 6717579264),
    ("a100-80gb", "7b", 8192, 8, 8, 2, 128, 3206, True, False, 3, 6684024832),
    ("a100-80gb", "7b", 4096, 8, 16, 2, 256, 3684, True, False, 3, 6667247616),
    ("a100-80gb", "7b", 2048, 8, 6, 2, 96, 4641, False, False, 3, 6658859008),
    ("a100-80gb", "7b", 1024, 8, 64, 2, 1024, 4357, True, False, 3, 6654664704),
    ("a100-80gb", "3b", 65536, 8, 1, 2, 16, 1767, True, False, 3, 2814366720),
    ("a100-80gb", "3b", 32768, 8, 3, 6, 144, 3029, True, False, 3, 2730480640),
    ("a100-80gb", "3b", 16384, 8, 1, 6, 48, 5529, False, False, 3, 2688537600),
    ("a100-80gb", "3b", 8192, 8, 3, 6, 144, 7695, False, False, 3, 2667566080),
    ("a100-80gb", "3b", 4096, 8, 5, 6, 240, 9457, False, False, 3, 2657080320),
    ("a100-80gb", "3b", 2048, 8, 10, 2, 160, 10811, False, False, 3, 2651837440),
    ("a100-80gb", "3b", 1024, 8, 20, 6, 960, 11580, False, False, 3, 2649216000),
    ("a100-80gb", "3b", 512, 8, 40, 6, 1920, 12127, False, False, 3, 2647905280),
    ("a100-80gb", "1b", 65536, 8, 1, 2, 16, 3044, True, False, 3, 1445974016),
    ("a100-80gb", "1b", 32768, 8, 1, 4, 32, 6275, False, False, 3, 1378865152),
    ("a100-80gb", "1b", 16384, 8, 2, 4, 64, 9956, False, False, 3, 1345310720),
    ("a100-80gb", "1b", 8192, 8, 3, 4, 96, 13814, False, False, 3, 1328533504),
    ("a100-80gb", "1b", 4096, 8, 7, 4, 224, 17807, False, False, 3, 1320144896),
    ("a100-80gb", "1b", 2048, 8, 14, 4, 448, 20513, False, False, 3, 1315950592),
    ("a100-80gb", "1b", 1024, 8, 18, 4, 576, 22112, False, False, 3, 1313853440),
    ("a100-80gb", "1b", 512, 8, 56, 4, 1792, 23148, False, False, 3, 1312804864),
    ("a100-80gb", "760m", 65536, 8, 1, 2, 16, 4143, True, False, 3, 857988096),
    ("a100-80gb", "760m", 32768, 8, 1, 2, 16, 8802, False, False, 3, 807656448),
    ("a100-80gb", "760m", 16384, 8, 3, 2, 48, 14274, False, False, 3, 782490624),
    ("a100-80gb", "760m", 8192, 8, 6, 2, 96, 20933, False, False, 3, 769907712),
    ("a100-80gb", "760m", 4096, 8, 12, 2, 192, 27351, False, False, 3, 763616256),
    ("a100-80gb", "760m", 2048, 8, 24, 2, 384, 32434, False, False, 3, 760470528),
    ("a100-80gb", "760m", 1024, 8, 48, 2, 768, 29765, False, False, 3, 758897664),
    ("a100-80gb", "760m", 512, 8, 96, 2, 1536, 29446, False, False, 3, 758111232),
    ("a100-80gb", "350m", 65536, 8, 1, 2, 16, 7524, False, False, 3, 420997120),
    ("a100-80gb", "350m", 32768, 8, 2, 2, 32, 13652, False, False, 3, 387442688),
    ("a100-80gb", "350m", 16384, 8, 4, 2, 64, 23559, False, False, 3, 370665472),
    ("a100-80gb", "350m", 8192, 8, 8, 2, 128, 36569, False, False, 3, 362276864),
    ("a100-80gb", "350m", 4096, 8, 16, 2, 256, 49555, False, False, 3, 358082560),
    ("a100-80gb", "350m", 2048, 8, 32, 2, 512, 58782, False, False, 3, 355985408),
    ("a100-80gb", "350m", 1024, 8, 64, 2, 1024, 64813, False, False, 3, 354936832),
    ("a100-80gb", "350m", 512, 8, 128, 2, 2048, 69330, False, False, 3, 354412544),
    ("a100-80gb", "125m", 65536, 8, 1, 2, 16, 20368, False, False, 3, 174070272),
    ("a100-80gb", "125m", 32768, 8, 2, 2, 32, 36407, False, False, 3, 148904448),
    ("a100-80gb", "125m", 16384, 8, 4, 2, 64, 60040, False, False, 3, 136321536),
    ("a100-80gb", "125m", 8192, 8, 8, 2, 128, 90392, False, False, 3, 130030080),
    ("a100-80gb", "125m", 4096, 8, 16, 2, 256, 118396, False, False, 3, 126884352),
    ("a100-80gb", "125m", 2048, 8, 40, 2, 640, 142830, False, False, 3, 125311488),
    ("a100-80gb", "125m", 2048, 8, 32, 2, 512, 141737, False, False, 3, 125311488),
    ("a100-80gb", "125m", 1024, 8, 64, 2, 1024, 156468, False, False, 3, 124525056),
    ("a100-80gb", "125m", 512, 8, 128, 2, 2048, 165681, False, False, 3, 124131840),
    # A100 40GB with 1600 Gbps node-node interconnect (RoCE)
    ("a100-40gb", "70b", 2048, 128, 4, 1, 512, 376, True, True, 3, 64862437376),
    ("a100-40gb", "70b", 2048, 64, 2, 1, 128, 276, True, True, 3, 64862437376),
    ("a100-40gb", "30b", 2048, 128, 6, 1, 768, 865, True, True, 3, 29975214080),
    ("a100-40gb", "30b", 2048, 32, 4, 1, 128, 857, True, True, 3, 29975214080),
    ("a100-40gb", "13b", 8192, 8, 1, 16, 128, 1407, True, True, 3, 12885411840),
    ("a100-40gb", "13b", 4096, 8, 2, 16, 256, 1603, True, True, 3, 12864440320),
    ("a100-40gb", "13b", 2048, 128, 16, 1, 2048, 1972, True, True, 3, 12853954560),
    ("a100-40gb", "13b", 2048, 64, 16, 1, 1024, 1976, True, True, 3, 12853954560),
    ("a100-40gb", "13b", 2048, 32, 14, 1, 448, 1998, True, True, 3, 12853954560),
    ("a100-40gb", "13b", 2048, 16, 10, 1, 160, 1993, True, True, 3, 12853954560),
    ("a100-40gb", "13b", 2048, 8, 4, 16, 512, 1668, True, True, 3, 12853954560),
    ("a100-40gb", "13b", 1024, 8, 8, 16, 1024, 1727, True, True, 3, 12848711680),
    ("a100-40gb", "13b", 512, 8, 16, 16, 2048, 1763, True, True, 3, 12846090240),
    ("a100-40gb", "7b", 16384, 8, 1, 4, 32, 2249, True, True, 3, 6717579264),
    ("a100-40gb", "7b", 8192, 8, 3, 4, 96, 2887, True, True, 3, 6684024832),
    ("a100-40gb", "7b", 4096, 8, 6, 4, 192, 3366, True, True, 3, 6667247616),
    ("a100-40gb", "7b", 2048, 128, 18, 1, 2304, 3623, True, True, 3, 6658859008),
    ("a100-40gb", "7b", 2048, 64, 18, 1, 1152, 3665, True, True, 3, 6658859008),
    ("a100-40gb", "7b", 2048, 32, 18, 1, 576, 3725, True, True, 3, 6658859008),
    ("a100-40gb", "7b", 2048, 16, 16, 1, 256, 3645, True, True, 3, 6658859008),
    ("a100-40gb", "7b", 2048, 8, 12, 4, 384, 3679, True, True, 3, 6658859008),
    ("a100-40gb", "7b", 1024, 8, 24, 4, 768, 3854, True, True, 3, 6654664704),
    ("a100-40gb", "7b", 512, 8, 48, 4, 1536, 3895, True, True, 3, 6652567552),
    ("a100-40gb", "3b", 32768, 8, 1, 4, 32, 2955, True, True, 3, 2730480640),
    ("a100-40gb", "3b", 16384, 8, 2, 8, 128, 4465, True, True, 3, 2688537600),
    ("a100-40gb", "3b", 8192, 8, 1, 8, 64, 7149, False, True, 3, 2667566080),
    ("a100-40gb", "3b", 4096, 8, 2, 8, 128, 8777, False, True, 3, 2657080320),
    ("a100-40gb", "3b", 2048, 128, 6, 1, 768, 9538, False, True, 3, 2651837440),
    ("a100-40gb", "3b", 2048, 64, 6, 1, 384, 9736, False, True, 3, 2651837440),
    ("a100-40gb", "3b", 2048, 32, 6, 1, 192, 9914, False, True, 3, 2651837440),
    ("a100-40gb", "3b", 2048, 16, 5, 1, 80, 9750, False, True, 3, 2651837440),
    ("a100-40gb", "3b", 2048, 8, 5, 8, 320, 10065, False, True, 3, 2651837440),
    ("a100-40gb", "3b", 1024, 8, 10, 8, 640, 10731, False, True, 3, 2649216000),
    ("a100-40gb", "3b", 512, 8, 20, 8, 1280, 11324, False, True, 3, 2647905280),
    ("a100-40gb", "1b", 32768, 8, 1, 4, 32, 5095, True, True, 3, 1378865152),
    ("a100-40gb", "1b", 16384, 8, 1, 8, 64, 9715, False, True, 3, 1345310720),
    ("a100-40gb", "1b", 8192, 8, 2, 8, 128, 13474, False, True, 3, 1328533504),
    ("a100-40gb", "1b", 4096, 8, 4, 8, 256, 16856, False, True, 3, 1320144896),
    ("a100-40gb", "1b", 2048, 128, 10, 1, 1280, 18647, False, True, 3, 1315950592),
    ("a100-40gb", "1b", 2048, 64, 10, 1, 640, 19001, False, True, 3, 1315950592),
    ("a100-40gb", "1b", 2048, 32, 10, 1, 320, 15555, False, True, 3, 1315950592),
    ("a100-40gb", "1b", 2048, 16, 8, 1, 128, 19085, False, True, 3, 1315950592),
    ("a100-40gb", "1b", 2048, 8, 8, 8, 512, 19271, False, True, 3, 1315950592),
    ("a100-40gb", "1b", 1024, 8, 16, 8, 1024, 20959, False, True, 3, 1313853440),
    ("a100-40gb", "1b", 512, 8, 32, 8, 2048, 21782, False, True, 3, 1312804864),
    ("a100-40gb", "760m", 32768, 8, 1, 4, 32, 7183, True, True, 3, 807656448),
    ("a100-40gb", "760m", 16384, 8, 1, 4, 32, 13914, False, True, 3, 782490624),
    ("a100-40gb", "760m", 8192, 8, 3, 4, 96, 20106, False, True, 3, 769907712),
    ("a100-40gb", "760m", 4096, 8, 6, 4, 192, 25863, False, True, 3, 763616256),
    ("a100-40gb", "760m", 2048, 128, 12, 1, 1536, 28940, False, True, 3, 760470528),
    ("a100-40gb", "760m", 2048, 64, 12, 1, 768, 29344, False, True, 3, 760470528),
    ("a100-40gb", "760m", 2048, 32, 12, 1, 384, 29648, False, True, 3, 760470528),
    ("a100-40gb", "760m", 2048, 16, 12, 1, 192, 29607, False, True, 3, 760470528),
    ("a100-40gb", "760m", 2048, 8, 12, 4, 384, 30173, False, True, 3, 760470528),
    ("a100-40gb", "760m", 1024, 8, 24, 4, 768, 33422, False, True, 3, 758897664),
    ("a100-40gb", "760m", 512, 8, 48, 4, 1536, 34938, False, True, 3, 758111232),
    ("a100-40gb", "350m", 32768, 8, 1, 4, 32, 13416, False, True, 3, 387442688),
    ("a100-40gb", "350m", 16384, 8, 2, 4, 64, 22896, False, True, 3, 370665472),
    ("a100-40gb", "350m", 8192, 8, 4, 4, 128, 34933, False, True, 3, 362276864),
    ("a100-40gb", "350m", 4096, 8, 8, 4, 256, 46833, False, True, 3, 358082560),
    ("a100-40gb", "350m", 2048, 128, 18, 1, 2304, 51934, False, True, 3, 355985408),
    ("a100-40gb", "350m", 2048, 64, 18, 1, 1152, 52689, False, True, 3, 355985408),
    ("a100-40gb", "350m", 2048, 32, 18, 1, 576, 53811, False, True, 3, 355985408),
    ("a100-40gb", "350m", 2048, 16, 18, 1, 288, 55413, False, True, 3, 355985408),
    ("a100-40gb", "350m", 2048, 8, 16, 4, 512, 55995, False, True, 3, 355985408),
    ("a100-40gb", "350m", 1024, 8, 32, 4, 1024, 62523, False, True, 3, 354936832),
    ("a100-40gb", "350m", 512, 8, 64, 4, 2048, 66284, False, True, 3, 354412544),
    ("a100-40gb", "125m", 32768, 8, 1, 4, 32, 32651, False, True, 3, 148904448),
    ("a100-40gb", "125m", 16384, 8, 2, 3, 48, 55484, False, True, 3, 136321536),
    ("a100-40gb", "125m", 8192, 8, 5, 3, 120, 86858, False, True, 3, 130030080),
    ("a100-40gb", "125m", 4096, 8, 13, 3, 312, 115162, False, True, 3, 126884352),
    ("a100-40gb", "125m", 2048, 128, 26, 1, 3328, 123936, False, True, 3, 125311488),
    ("a100-40gb", "125m", 2048, 64, 26, 1, 1664, 125234, False, True, 3, 125311488),
    ("a100-40gb", "125m", 2048, 32, 26, 1, 832, 127122, False, True, 3, 125311488),
    ("a100-40gb", "125m", 2048, 16, 26, 1, 416, 130535, False, True, 3, 125311488),
    ("a100-40gb", "125m", 2048, 8, 26, 3, 624, 136334, False, True, 3, 125311488),
    ("a100-40gb", "125m", 1024, 8, 52, 3, 1248, 148289, False, True, 3, 124525056),
    ("a100-40gb", "125m", 512, 8, 104, 3, 2496, 156735, False, True, 3, 124131840),
)
# MPT sizes, llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml: (layers, d_model, heads); vocabulary 50,368,
# expansion ratio 4, and MPT's defaults where the files say nothing (llmfoundry/models/mpt/configuration_mpt.py):
# biases, a learned position table of one row per token of the sequence, LayerNorm, the output layer tied to the
# embedding; no dropout in the runs. Counted by ModelSpec, every row has exactly its NumParams (tests/test_plan.py)
MPT_SIZES = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
             "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 64),
             "70b": (80, 8192, 64)}
# the rows that ran FlashAttention-2 (table, MPT size): sweep.py of 5e85bd62d, --attn_impl flash
FLASH_ROWS = {("h100-80gb-large", size) for size in ("1b", "3b", "7b", "70b")}
# each table's title and GPUs: A100 80GB and 40GB (datasheet: 40GB SXM, 1,555 GB/s of HBM), H100 80GB
MOSAIC_TABLES = {"h100-80gb-large": ("H100 80GB BF16 (Large Scale, >= 128 GPUs)", dict(gpu="h100")),
                 "h100-80gb": ("H100 80GB BF16", dict(gpu="h100")),
                 "a100-80gb": ("A100 80GB", dict(gpu="a100")),
                 "a100-40gb": ("A100 40GB", dict(gpu="a100", gpu_mem_gib=40, hbm_bw_gbps=1555.0))}


def mpt_spec(size: str, seq_len: int = 2048) -> ModelSpec:
    """An MPT model of MPT_SIZES trained on sequences of seq_len tokens (its position table has as many rows)."""
    layers, hidden, heads = MPT_SIZES[size]
    return ModelSpec(layers, hidden, heads, 50368, seq_len, tied_embeddings=True, dropout=False, name=f"mpt-{size}")


def mosaic_run(table, size, seq_len, n, micro, accumulation, batch, tokens_s, checkpointing, pure, zero,
               n_params=None) -> PublishedRun:
    """One row of MOSAIC_RUNS as a run (n_params: the table's count, checked by the tests, not used here)."""
    layout = Layout(dp=n, zero=zero, micro_batch=micro, recompute="full" if checkpointing else None)
    tokens = "" if seq_len == 2048 else f" at {seq_len:,} tokens"
    title, gpus = MOSAIC_TABLES[table]
    cluster = Cluster.of(n, **gpus)
    name = f"MPT-{size}{tokens}, {n} {gpus['gpu'].upper()} {cluster.gpu_mem_gib:.0f}GB, b {micro} x {accumulation}"
    return PublishedRun(
        name, mpt_spec(size, seq_len), cluster, layout, batch,
        "mixed_adam" if pure else "mixed_adam_fp32_grads", f"{tokens_s:,} tokens/s per GPU",
        batch * seq_len / (n * tokens_s), f"mosaicml/llm-foundry scripts/train/benchmarking/README.md, table {title}",
        attention="flash" if (table, size) in FLASH_ROWS else "flash-triton", gpu=gpus["gpu"],
        search=SOFTWARE["composer-fsdp"], checkpoint_early_stop=not pure,  # DEFAULT rows: PyTorch 2.1 (docstring)
        assumed="FSDP gathers the bf16 weights and reduce-scatters the gradients every micro-batch (no no_sync); "
                "attention and PyTorch's version as the scripts committed with the table say (module docstring)")


def fsdp_runs() -> list[PublishedRun]:
    """Every run at 2,048 tokens: held out, shown apart as another engine."""
    return [mosaic_run(*row) for row in MOSAIC_RUNS if row[2] == 2048]


def fsdp_training_runs() -> list[PublishedRun]:
    """Every run at another sequence length: what fits the attention kernel's speed (validate.fit_attention)."""
    return [mosaic_run(*row) for row in MOSAIC_RUNS if row[2] != 2048]
