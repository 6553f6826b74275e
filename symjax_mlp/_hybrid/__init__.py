"""Stage 1 of the flow: a model and its arguments to a Hybrid, its Graph and trace log."""
