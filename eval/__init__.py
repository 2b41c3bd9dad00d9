"""Stage 6, eval: lm-eval through the sparse runtime, speed bench, scorecard (issue 6)."""
