"""A training run's life: its folder's layout (folder), one job per folder (lock), a graceful stop on
signals (preemption), garbage collection at chosen steps (gc_schedule), loss spikes (spikes) and the record
of a bad step (bad_batch), hangs (watchdog), and the fault hooks the tests inject (faults)."""
