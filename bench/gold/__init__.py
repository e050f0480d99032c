"""The gold-judge experiment (Gao et al. 2022, "Scaling Laws for Reward Model Overoptimization"):
simulated annotators rank the policy's responses by a fixed judge's score (the "gold"); a proxy
reward model learns from those pairs; PPO (or DPO) optimises against it; and the judge, which
nothing trains on, says whether the policy got better.

Research, not product: it runs the product's own rounds as jobs of a store (pipeline/orchestrate)
and reads their outputs. Entry point: closed_loop.py (the default round over seeds and rounds, on
the locked test prompts of prompt_sets.py), its report closed_report.py; docs/results/ holds the
published runs, the earlier experiments' pages with the commit whose code made them. Its test:
tests/test_gold_experiment.py.
"""
