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
"""

FITTED = dict(a100=0.8587, h100=0.6802, nvlink=0.7674, network=0.9999, hbm=0.87)
