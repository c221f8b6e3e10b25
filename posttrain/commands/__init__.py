"""Command-line work that draws on several rooms, so it sits above them all: ``posttrain prep``
(`prep`: the data room's preparations plus ``prep pairs``, which samples a model and scores the
samples, `pairs`). `posttrain.cli` routes here; each room below keeps only its own work.
"""
