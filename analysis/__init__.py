"""Tables and figures from logged runs (a local ``runs/`` folder); never loads a model."""
