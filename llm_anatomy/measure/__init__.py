"""Instruments: they measure a real model and never read the calculator."""
