"""The demo model's training pipeline, one module per step (run it with scripts/train_demo_model.py)."""
