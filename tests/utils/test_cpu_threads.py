"""torch's intra-op threads on a CPU: OMP_NUM_THREADS when set, else the usable cores shared by the local ranks."""

import os

import torch

from atma_titan.utils.device import CpuThreads, choose_cpu_threads, set_cpu_threads, usable_cores


def test_without_omp_num_threads_the_cores_are_shared_by_the_local_ranks():
    assert choose_cpu_threads({}, cores=2) == CpuThreads(2, "2 cores / 1 local rank; OMP_NUM_THREADS unset", 2, 1)
    assert choose_cpu_threads({"LOCAL_WORLD_SIZE": "2"}, cores=2).count == 1
    assert choose_cpu_threads({"LOCAL_WORLD_SIZE": "4"}, cores=16).count == 4
    assert choose_cpu_threads({"LOCAL_WORLD_SIZE": "3"}, cores=8).count == 2  # rounded down: never oversubscribed
    assert choose_cpu_threads({"LOCAL_WORLD_SIZE": "8"}, cores=2).count == 1  # at least one
    described = choose_cpu_threads({"LOCAL_WORLD_SIZE": "2"}, cores=2).describe()
    assert described == "cpu threads: 1 per rank (2 cores / 2 local ranks; OMP_NUM_THREADS unset)"


def test_omp_num_threads_is_respected_and_a_bad_value_is_named():
    assert choose_cpu_threads({"OMP_NUM_THREADS": "3"}, cores=2) == CpuThreads(3, "OMP_NUM_THREADS=3", 2, 1)
    # torchrun sets 1 for several local ranks when the variable is unset: the header says whose 1 it may be
    torchrun = choose_cpu_threads({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}, cores=16)
    assert torchrun.count == 1 and "torchrun's default" in torchrun.reason
    bad = choose_cpu_threads({"OMP_NUM_THREADS": "0", "LOCAL_WORLD_SIZE": "2"}, cores=4)
    assert bad == CpuThreads(2, "4 cores / 2 local ranks; OMP_NUM_THREADS='0' is not a positive integer", 4, 2)


def test_the_usable_cores_are_this_process_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0))  # a taskset or a scheduler's share, not the machine's
    assert choose_cpu_threads({}).count == usable_cores()


def test_set_cpu_threads_sets_torch_on_the_cpu_only():
    before = torch.get_num_threads()
    try:
        choice = set_cpu_threads(torch.device("cpu"), {"OMP_NUM_THREADS": "1"})
        assert choice.count == 1 and torch.get_num_threads() == 1
        assert set_cpu_threads(torch.device("cuda", 0), {"OMP_NUM_THREADS": "3"}) is None
        assert torch.get_num_threads() == 1  # a GPU's process is left as it is
    finally:
        torch.set_num_threads(before)


def test_a_machine_whose_other_jobs_leave_too_few_cores_is_a_warning_naming_the_way_out():
    alone = choose_cpu_threads({}, cores=2)
    assert alone.crowded(0.2) is None  # an idle machine
    said = alone.crowded(1.0)  # one other job: one of the two threads is descheduled at every op
    assert said.startswith("the load average is 1.0 on 2 cores") and said.endswith("OMP_NUM_THREADS=1 avoids that")
    assert choose_cpu_threads({"OMP_NUM_THREADS": "1"}, cores=2).crowded(5.0) is None  # one thread waits for none
    assert choose_cpu_threads({"LOCAL_WORLD_SIZE": "2"}, cores=16).crowded(1.0) is not None  # 1 + 2 x 8 > 16
    assert choose_cpu_threads({"OMP_NUM_THREADS": "4"}, cores=16).crowded(8.0) is None  # cores to spare
