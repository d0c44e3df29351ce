"""Rollouts: sampling and truncation (generate), the immutable batch of experience, and reward sources."""
