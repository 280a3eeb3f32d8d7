import pytest

from sglang.srt.server_args import ServerArgs, build_parser, prepare_server_args

# The seed's two command lines (node 0 and node 1 of a two-node launch), model path substituted.
SEED_NODE0 = (
    "--model-path {m} --dist-init-addr 127.0.0.1:5000 --nnodes 2 --node-rank 0 --trust-remote-code "
    "--served-model-name deepseek --context-length 4096 --tp-size 2 --stream-output --host 127.0.0.1 --port 30000 "
    "--watchdog-timeout 1000 --disable-radix-cache --schedule-policy fcfs --chunked-prefill-size 4096 "
    "--max-running-requests 64 --disable-overlap-schedule --attention-backend triton --enable-metrics "
    "--log-requests --disable-cuda-graph-padding --mem-fraction-static 0.8 --speculative-algo NEXTN "
    "--speculative-draft {m}-nextn --speculative-num-steps 3 --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens 4 --enable-dp-attention --dp-size 2"
)
SEED_NODE1 = (
    "--model-path {m} --dist-init-addr 127.0.0.1:5000 --nnodes 2 --node-rank 1 --trust-remote-code "
    "--tensor-parallel-size 2 --speculative-algorithm NEXTN --speculative-draft-model-path {m}-nextn "
    "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --disable-cuda-graph "
    "--enable-nan-detection --enable-dp-attention --dp-size 2 --device cuda --dtype bfloat16 --load-format dummy"
)


@pytest.mark.parametrize("line", [SEED_NODE0, SEED_NODE1])
def test_seed_command_lines_parse(line):
    args = prepare_server_args(line.format(m="/models/DeepSeek-V3").split())
    assert args.speculative_algorithm == "NEXTN"
    assert args.speculative_draft_model_path == "/models/DeepSeek-V3-nextn"
    assert (args.tp_size, args.dp_size, args.enable_dp_attention) == (2, 2, True)
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    assert args.nnodes == 2 and args.dist_init_addr == "127.0.0.1:5000"
    assert args.attn_tp_size == 1


def test_defaults_match_sglang():
    args = prepare_server_args(["--model-path", "m", "--device", "cpu"])
    assert (args.host, args.port, args.tp_size, args.dp_size) == ("127.0.0.1", 30000, 1, 1)
    assert args.schedule_policy == "fcfs" and not args.disable_radix_cache
    assert args.attention_backend == "torch_native" and args.page_size == 1
    assert args.tokenizer_path == "m" and args.served_model_name == "m"
    assert args.not_supported_yet() is None


def test_every_field_has_a_flag():
    parser = build_parser()
    dests = {a.dest for a in parser._actions}
    import dataclasses

    assert {f.name for f in dataclasses.fields(ServerArgs)} <= dests


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--enable-dp-attention"], "--enable-dp-attention"),
        (["--tp-size", "3", "--dp-size", "2", "--enable-dp-attention"], "--tp-size"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
        (["--speculative-num-steps", "3"], "--speculative-algorithm"),
        (["--speculative-algorithm", "EAGLE"], "--speculative-draft-model-path"),
        (["--nnodes", "2"], "--dist-init-addr"),
        (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
        (["--schedule-policy", "random"], "--schedule-policy"),
        (["--speculative-adaptive"], "--speculative-algorithm"),
        (["--speculative-algorithm", "NEXTN", "--speculative-adaptive-steps", "1,3"], "--speculative-adaptive"),
        (
            [
                "--speculative-algorithm",
                "NEXTN",
                "--speculative-adaptive",
                "--speculative-eagle-topk",
                "4",
                "--speculative-num-steps",
                "3",
                "--speculative-num-draft-tokens",
                "8",
            ],
            "--speculative-eagle-topk 1",
        ),
        (
            ["--speculative-algorithm", "NEXTN", "--speculative-adaptive", "--speculative-num-steps", "2"],
            "--speculative-num-steps 2",
        ),
        (
            ["--speculative-algorithm", "NEXTN", "--speculative-adaptive", "--speculative-adaptive-steps", "1,x"],
            "--speculative-adaptive-steps",
        ),
        (
            ["--speculative-algorithm", "NEXTN", "--speculative-adaptive", "--speculative-adaptive-steps", "3"],
            "at least two tiers",
        ),
        (
            ["--speculative-algorithm", "NEXTN", "--speculative-adaptive", "--speculative-adaptive-schedule", "3:2,2:1"],
            "not a tier",
        ),
        (
            ["--speculative-algorithm", "NEXTN", "--speculative-adaptive", "--speculative-adaptive-schedule", "3-2"],
            "steps:cycles",
        ),
    ],
)
def test_invalid_combinations_name_the_flag(extra, flag, capsys):
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", "m", "--device", "cpu", *extra])
    assert flag in capsys.readouterr().err


def test_adaptive_speculation_defaults():
    """Without sizes, a chain of the largest tier; --speculative-num-steps is the starting tier."""
    args = prepare_server_args(
        ["--model-path", "m", "--device", "cpu", "--speculative-algorithm", "NEXTN", "--speculative-adaptive"]
    )
    assert args.speculative_tiers == (1, 3, 5)
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (5, 1, 6)
    args = prepare_server_args(
        [
            "--model-path",
            "m",
            "--device",
            "cpu",
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-adaptive",
            "--speculative-adaptive-steps",
            "4,2",
            "--speculative-num-steps",
            "2",
            "--speculative-adaptive-schedule",
            "2:3,4:1",
        ]
    )
    assert args.speculative_tiers == (2, 4) and args.speculative_num_draft_tokens == 3
    assert args.speculative_adaptive_schedule_pairs == [(2, 3), (4, 1)]


def test_later_features_say_not_supported_yet():
    args = prepare_server_args(["--model-path", "m", "--device", "cpu", "--page-size", "16"])
    with pytest.raises(ValueError, match="not supported yet"):
        args.check_launchable()


def test_gpu_backend_on_cpu_fails_at_launch():
    args = prepare_server_args(["--model-path", "m", "--device", "cpu", "--attention-backend", "triton"])
    with pytest.raises(ValueError, match="--attention-backend"):
        args.check_launchable()


def test_every_flag_is_documented():
    import os

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "server_arguments.md")).read()
    for action in build_parser()._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}`" in doc, flag
