"""A run's document and what renders it: the results schema and its writing (`results.py`),
the Markdown report and CSV (`render.py`), the figures (`figures.py`, `plot_styles.py`), how a
cell is named (`labels.py`), and the metrics the sections hold (`metrics.py`,
`cluster_metrics.py`)."""
