"""The --dp-size launcher's plans, without starting a process: worker flags, the router's command
line, and how devices are split (jaxserve/launch/data_parallel.py)."""

from __future__ import annotations

import pytest

from jaxserve.launch.data_parallel import DeviceShare, Platform, device_shares, router_argv, worker_argv, worker_ports
from jaxserve.server_args import ServerArgs


def test_workers_get_the_flags_as_given_on_their_own_ports():
    args = ServerArgs.from_cli(["--model-path", "/m", "--port", "8000", "--host", "0.0.0.0", "--dp-size", "3",
                                "--max-total-tokens", "2048", "--disable-radix-cache", "--router-policy", "round_robin"])
    assert worker_ports(args) == [8001, 8002, 8003]
    argv = worker_argv(args, 8002)
    assert argv == ["--model-path", "/m", "--max-total-tokens", "2048", "--disable-radix-cache",
                    "--host", "127.0.0.1", "--port", "8002"]
    # every flag a worker gets parses back to the launcher's value (a worker never launches a router)
    back = ServerArgs.from_cli(argv)
    assert back.dp_size == 1 and back.max_total_tokens == 2048 and back.disable_radix_cache and back.port == 8002


def test_the_router_listens_on_port_with_cache_aware_by_default():
    args = ServerArgs.from_cli(["--port", "8000", "--dp-size", "2"])
    argv = router_argv(args, ["http://127.0.0.1:8001", "http://127.0.0.1:8002"])
    assert argv[1:3] == ["-m", "sglang_router.launch_router"]

    def value(flag):
        return argv[argv.index(flag) + 1]

    assert value("--policy") == "cache_aware" and value("--port") == "8000" and value("--host") == "127.0.0.1"
    assert argv[argv.index("--worker-urls") + 1:argv.index("--worker-urls") + 3] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert value("--prometheus-port") == "8003"
    assert "--api-key" not in argv
    keyed = router_argv(ServerArgs.from_cli(["--dp-size", "2", "--api-key", "k", "--router-policy", "random"]), [])
    assert keyed[keyed.index("--api-key") + 1] == "k" and keyed[keyed.index("--policy") + 1] == "random"


def test_the_routers_own_parser_accepts_the_command_line():
    from sglang_router.launch_router import parse_router_args

    args = ServerArgs.from_cli(["--port", "8000", "--dp-size", "2", "--router-policy", "power_of_two", "--api-key", "k"])
    parsed = parse_router_args(router_argv(args, ["http://127.0.0.1:8001", "http://127.0.0.1:8002"])[3:])
    assert parsed.policy == "power_of_two" and parsed.port == 8000 and parsed.api_key == "k"
    assert parsed.worker_urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


def test_cpu_cores_are_split_into_contiguous_sets():
    assert device_shares(Platform("cpu", 5), 2, [0, 1, 2, 3, 4], None) == [DeviceShare(cpus=(0, 1, 2)), DeviceShare(cpus=(3, 4))]
    assert device_shares(Platform("cpu", 2), 2, [4, 7], None) == [DeviceShare(cpus=(4,)), DeviceShare(cpus=(7,))]
    # fewer cores than workers: they share all of them
    assert device_shares(Platform("cpu", 1), 2, [0], None) == [DeviceShare(), DeviceShare()]


def test_gpus_are_split_through_cuda_visible_devices():
    # each worker gets exactly --tp-size GPUs (a tp-1 worker would use only the first of several)
    shares = device_shares(Platform("gpu", 4), 2, [0], None)
    assert [dict(s.env) for s in shares] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    shares = device_shares(Platform("gpu", 4), 2, [0], None, tp_size=2)
    assert [dict(s.env) for s in shares] == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    shares = device_shares(Platform("gpu", 8), 3, [0], ["1", "2", "3", "4", "5", "6", "7"], tp_size=2)
    assert [dict(s.env)["CUDA_VISIBLE_DEVICES"] for s in shares] == ["1,2", "3,4", "5,6"]
    shares = device_shares(Platform("gpu", 3), 3, [0], ["5", "6", "7"])
    assert [dict(s.env)["CUDA_VISIBLE_DEVICES"] for s in shares] == ["5", "6", "7"]
    with pytest.raises(ValueError, match="--dp-size 2 x --tp-size 1 needs 2 GPUs; 1 visible"):
        device_shares(Platform("gpu", 1), 2, [0], None)
    with pytest.raises(ValueError, match="--dp-size 2 x --tp-size 3 needs 6 GPUs; 4 visible"):
        device_shares(Platform("gpu", 4), 2, [0], None, tp_size=3)
    with pytest.raises(ValueError, match="tpu"):
        device_shares(Platform("tpu", 8), 2, [0], None)


def test_cpu_workers_with_tp_get_that_many_host_devices():
    shares = device_shares(Platform("cpu", 4), 2, [0, 1, 2, 3], None, tp_size=3)
    assert [s.cpus for s in shares] == [(0, 1), (2, 3)]
    assert [dict(s.env) for s in shares] == [{"JAX_NUM_CPU_DEVICES": "3"}] * 2
    assert device_shares(Platform("cpu", 1), 2, [0], None, tp_size=2) == [DeviceShare(env=(("JAX_NUM_CPU_DEVICES", "2"),))] * 2
    # the worker's flags keep --tp-size: each worker runs its own tp-3 mesh over those devices
    args = ServerArgs.from_cli(["--dp-size", "2", "--tp-size", "3", "--port", "8000"])
    assert worker_argv(args, 8001) == ["--tp-size", "3", "--host", "127.0.0.1", "--port", "8001"]


def test_bad_dp_flags_are_refused():
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--dp-size", "0"])
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--dp-size", "2", "--router-policy", "fastest"])
    with pytest.raises(ValueError, match="--dp-size"):
        ServerArgs(dp_size=4, port=65533).validate()


def test_a_childs_colour_codes_stay_out_of_the_log(capsys):
    """Before: sglang-router's log lines (it colours them whatever NO_COLOR says) reached log files
    with their ANSI escapes ("\\x1b[2m2026-...\\x1b[0m")."""
    import sys

    from jaxserve.launch.data_parallel import _Child

    child = _Child("router", [sys.executable, "-c", r"print('\x1b[2m12:00:00\x1b[0m \x1b[32m INFO\x1b[0m up')"])
    assert child.proc.wait(30) == 0
    child._pump.join(10)
    assert capsys.readouterr().out == "router| 12:00:00  INFO up\n"
