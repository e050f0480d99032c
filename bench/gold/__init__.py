"""The gold-judge experiment (Gao et al. 2022, "Scaling Laws for Reward Model Overoptimization"):
simulated annotators rank the policy's responses by a fixed judge's score (the "gold"); a proxy
reward model learns from those pairs; PPO (and DPO, best-of-n, a shuffled-label control) optimise
against the proxy; and the judge, which nothing trains on, says whether the policy got better.

Research, not product: it runs the product's stages as jobs of a store (pipeline/orchestrate) and
reads their outputs. Entry points: loop.py (one run of rounds and arms), seeds.py (arms over seeds
with checkpoints, and its report seed_report.py), curve.py (gold against the number of pairs);
docs/results/ holds the published runs. Its test: tests/test_gold_experiment.py.
"""
