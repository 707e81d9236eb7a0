"""Planner and simulator: a written-down cost model of memory and step time for any parallel layout.

`cluster` describes the hardware, `shape` counts parameters and FLOPs analytically, `memory` and
`timing` price one layout, `search` enumerates and ranks layouts, `simulate` sweeps cluster sizes and
`calibrate` measures this machine. The CLI verbs (`plan`, `simulate`, `calibrate`) live in `cli`.
"""
