"""How a run is made: a cell's configuration and its execution (`runner.py`), the grid of cells
and its sweep (`sweep.py`, `cluster_grid.py`), processes and Ray for the cells (`cell_pool.py`,
`cell_runs.py`, `ray_runner.py`), the cells kept for a resume (`cell_store.py`), atomic output
folders (`output_dir.py`) and interrupts (`interrupts.py`), what a result depends on
(`provenance.py`), the options file (`run_config.py`), backend options (`backend_options.py`),
capacities (`sizing.py`), arrivals re-timed (`retiming.py`), the model's fit (`model_fit.py`),
and the defaults (`defaults.py`)."""
