"""Measurement: profiling layouts on real cores, characterisation, load generation, statistics, the profile cache."""
