"""Structured output: grammar backends behind one small interface (base.py), chosen by
name (registry.py), and the engine core's manager (manager.py)."""
