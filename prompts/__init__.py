"""Prompt sets (sets.py: .txt and .jsonl files, held-out evaluation records) and each prompt's shape
(shapes.py: height, width, frames, checked against the model, and the cost table the step plan
dispatches with).

May import rl/ and parallel/ (the step plan's ShapeTable)."""
