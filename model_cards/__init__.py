"""Model-card templates (package data), filled when a model is exported."""
