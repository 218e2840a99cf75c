"""The cost model's free constants, fitted on the training runs of shardlib/plan/published.py by
shardlib.plan.validate.fit() (least squares on log step time; `python -m shardlib plan --validate --fit`
refits and prints them; tests/test_plan.py refits and holds these to the result):

    a100, h100  the fraction of the GPU's measured matmul ceiling (Cluster.matmul_tflops) a training job's
                products reach, per GPU: the measured ceiling is a best shape in a short loop, a training step
                is many shapes, power- and clock-limited over hours
    nvlink      the fraction of the nominal NVLink bandwidth collectives inside a node reach (bus bandwidth)
    network     the same between nodes (for a group with k GPUs in a node, of k times one GPU's share: links.py);
                fitted at the bound, 1: the training runs would take inter-node collectives faster still
    hbm         the fraction of the HBM peak memory-bound kernels reach

ATTENTION_TRITON, apart: the fraction of the GPU's datasheet peak FlashAttention's Triton kernel reaches (the
attention="flash-triton" of the planner), fitted by shardlib.plan.validate.fit_attention() on MosaicML's runs at
other lengths than 2,048 tokens (shardlib/plan/mosaic.py, fsdp_training_runs), which ran it. FlashAttention's
first version reaches 25-40% of an A100's peak (arXiv 2307.08691, Sec. 1), FlashAttention-2 35% of an H100's
(arXiv 2407.08608, abstract): a kernel written for the A100 does worse on the H100.
"""

FITTED = dict(a100=0.8599, h100=0.6952, nvlink=0.745, network=0.9999, hbm=0.8787)
ATTENTION_TRITON = dict(a100=0.31, h100=0.18)
