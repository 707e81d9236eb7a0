"""When a run goes wrong at scale, where: hung ranks (`hang`), stragglers (`stragglers`), memory
(`memory_snapshot`) and each rank's own warnings (`rank_logs`), put together for the loop by `run`.

Nothing here costs a step anything when nothing goes wrong: a watchdog thread that wakes about once a
second, two clock readings per step, and two numbers in the metrics collective the step makes anyway.
"""
