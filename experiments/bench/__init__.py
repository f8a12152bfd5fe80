"""Benchmarks: not tests. Each writes JSON and reports medians over repeated runs."""
