"""Smoke tests of the benchmarks: each runs and prints its table (their numbers are not checked: speed, memory and
learning are measured by the benchmarks themselves, side by side, never by timed or seeded unit tests)."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    if str(BENCHMARKS) not in sys.path:  # as when the script runs: its folder first, for `provenance`
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_provenance(folder: Path, command: str) -> dict:
    """The folder's record names the command that wrote it, a commit of this repository, the machine and versions."""
    (run,) = json.loads((folder / "provenance.json").read_text())["runs"]
    assert run["command"] == command
    root = BENCHMARKS.parent
    if (root / ".git").exists():
        subprocess.run(["git", "cat-file", "-e", f"{run['commit']}^{{commit}}"], cwd=root, check=True)
        assert isinstance(run["dirty"], bool)
    assert run["machine"]["cpu"] and run["machine"]["cores"] >= 1 and run["seconds"] >= 0
    assert {"torch", "transformers", "trl", "peft"} <= set(run["versions"]) and run["started"].startswith("20")
    return run


def test_cost_benchmark_prints_ratio_table(capsys, tmp_path):
    options = ["--quick", "--steps", "2", "--lengths", "16", "--batches", "2", "--out", str(tmp_path)]
    table = load("cost").main(options)
    out = capsys.readouterr().out
    assert table in out
    header, _rule, *rows = table.splitlines()
    for column in ("TOPR/SFT", "TOPR+pre total/SFT total", "TOPR/KTO", "mem TOPR/SFT"):
        assert column in header
    assert len(rows) == 1 and rows[0].startswith("| 16 | 2 |")
    assert len(rows[0].split("|")) == len(header.split("|"))
    check_provenance(tmp_path, "python benchmarks/cost.py " + " ".join(options))
    results = json.loads((tmp_path / "results.json").read_text())
    (cell,) = results["cells"]
    assert set(cell["runs"]) == {"SFT", "TOPR", "TOPR+pre", "KTO"} and len(cell["runs"]["SFT"][0]["times"]) == 2
    assert table in (tmp_path / "table.md").read_text()


def test_cost_benchmark_compares_batch_layouts_on_uneven_lengths(capsys, tmp_path):
    options = ["--mix", "--quick", "--steps", "2", "--batches", "3", "--max_length", "48", "--out", str(tmp_path)]
    table = load("cost").main(options)
    assert table in capsys.readouterr().out
    header, _rule, row = table.splitlines()
    cells = dict(zip(header.strip("|").split("|"), row.strip("|").split("|")))
    cells = {name.strip(): value.strip() for name, value in cells.items()}
    for name in ("SFT-pf tok/s", "TOPR tok/s", "TOPR-pf tok/s", "TOPR-grouped tok/s", "TOPR-pf/SFT-pf"):
        assert float(cells[name]) > 0
    check_provenance(tmp_path, "python benchmarks/cost.py " + " ".join(options))
    (cell,) = json.loads((tmp_path / "results.json").read_text())["cells"]
    runs = cell["runs"]
    # padding-free batches hold exactly the dataset's tokens (two epochs); padded ones more, grouped ones less so
    for name in ("SFT-pf", "TOPR-pf"):
        assert runs[name][0]["held_tokens"] == 2 * cell["tokens"]
    assert runs["TOPR"][0]["held_tokens"] > runs["TOPR-grouped"][0]["held_tokens"] > 2 * cell["tokens"]
    assert len(runs["TOPR"][0]["times"]) == 4  # 2 steps an epoch, 2 epochs


def test_cost_benchmark_profiles_each_trainer(capsys, tmp_path):
    load("cost").main(
        [
            "--quick",
            "--steps",
            "3",
            "--lengths",
            "16",
            "--batches",
            "2",
            "--trainers",
            "SFT",
            "TOPR",
            "--profile",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    for name in ("SFT", "TOPR"):
        section = out.split(f"{name}, L=16, batch 2: CPU self time per profiled step (ms)")[1].split("\n\n")[1]
        _header, _rule, total, *rows = section.splitlines()
        assert total.startswith("| all operators |")
        ms = [float(row.split("|")[-3]) for row in rows]
        assert 0 < ms[-1] and ms == sorted(ms, reverse=True) and sum(ms) <= float(total.split("|")[2])
        assert any("mm" in row for row in rows)  # the matrix products are among a step's costliest operators


def test_learning_benchmark_runs_every_method(capsys, tmp_path):
    learning = load("learning")
    table = learning.main(["--scale", "fast", "--quick", "--out", str(tmp_path)])
    assert table in capsys.readouterr().out
    header, _rule, mu_row, *rows = table.split("\n\n")[0].splitlines()
    assert "Δ greedy vs topr" in header and mu_row.startswith("| mu (epoch 0) |")
    assert [row.split("|")[1].strip() for row in rows] == list(learning.METHODS)
    results = json.loads((tmp_path / "results.json").read_text())
    for method in learning.METHODS:
        (epoch,) = results["methods"][method][0]  # one seed, one epoch
        assert {"pass@1_greedy", "invalid_rate", "truncated_rate", "logp_positive", "logp_negative"} <= set(epoch)
    assert (tmp_path / "learning.png").stat().st_size > 0 and (tmp_path / "table.md").exists()
    check_provenance(tmp_path, f"python benchmarks/learning.py --scale fast --quick --out {tmp_path}")


def test_sampling_benchmark_prints_ratio_table(capsys, tmp_path):
    table = load("sampling").main(["--quick", "--reps", "1", "--max_new_tokens", "4", "--out", str(tmp_path)])
    assert table in capsys.readouterr().out
    header, _rule, *rows = table.splitlines()
    assert "ratio" in header
    assert [row.split("|")[1].strip() for row in rows] == [
        "sampling",
        "precompute",
        "precompute's forward alone (fused LM head)",
    ]
    assert all(float(row.split("|")[4]) > 0 for row in rows)
    check_provenance(tmp_path, f"python benchmarks/sampling.py --quick --reps 1 --max_new_tokens 4 --out {tmp_path}")
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["tokens_per_s"]) == {"sampler", "generate", "precompute", "forward", "fused"}


def test_tool_turns_benchmark_prints_every_engine_and_its_speed_up(capsys, tmp_path):
    table = load("tool_turns").main(["--quick", "--reps", "1", "--out", str(tmp_path)])
    assert table in capsys.readouterr().out
    header, _rule, seconds, speedup, *rest = table.splitlines()
    assert "before" in header and all(float(cell) > 0 for cell in seconds.split("|")[2:5])
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["median_seconds"]) == ["before", "turns", "after"] and results["greedy_same"] is True
    assert results["speedup"]["before"] == 1 and speedup.split("|")[4].strip() == f"{results['speedup']['after']:.2f}"
    check_provenance(tmp_path, f"python benchmarks/tool_turns.py --quick --reps 1 --out {tmp_path}")


def test_precision_benchmark_prints_both_precisions_and_the_choice(capsys, tmp_path):
    table = load("precision").main(["--quick", "--reps", "1", "--out", str(tmp_path)])
    assert table in capsys.readouterr().out
    header, _rule, row = table.splitlines()
    assert "bf16/fp32" in header and row.split("|")[-2].strip() in ("bf16", "fp32")
    check_provenance(tmp_path, f"python benchmarks/precision.py --quick --reps 1 --out {tmp_path}")
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["picks"] == row.split("|")[-2].strip() and results["fp32_gflops"] > 0


def test_allocator_benchmark_puts_both_settings_side_by_side(capsys, tmp_path):
    table = load("allocator").main(["--quick", "--reps", "2", "--out", str(tmp_path)])
    assert table in capsys.readouterr().out
    header, _rule, seconds, peak = table.splitlines()
    assert "MALLOC_MMAP_THRESHOLD_=1048576" in header
    results = json.loads((tmp_path / "results.json").read_text())
    assert [len(runs) for runs in results["runs"].values()] == [2, 2] and results["checkpointing"] is True
    median = results["median_seconds"]
    assert results["seconds_ratio"] == pytest.approx(median["mmap"] / median["default"])
    assert seconds.split("|")[-2].strip() == f"{results['seconds_ratio']:.2f}"
    assert peak.split("|")[-2].strip() == f"{results['peak_ratio']:.2f}"
    assert all(run["peak"] > 0 for runs in results["runs"].values() for run in runs)
    assert {run["env"] for run in results["runs"]["default"]} == {None}
    assert {run["env"] for run in results["runs"]["mmap"]} == {"1048576"}
    check_provenance(tmp_path, f"python benchmarks/allocator.py --quick --reps 2 --out {tmp_path}")


def test_memory_benchmark_puts_labelled_runs_side_by_side(capsys, tmp_path, tiny_model_path):
    memory = load("memory")
    options = ["--model", tiny_model_path, "--prompts", "2", "--max_new_tokens", "4", "--out", str(tmp_path)]
    memory.main(options + ["--label", "first", "--rounds", "3"])
    table = memory.main(options + ["--label", "second", "--rounds", "1"])
    assert table in capsys.readouterr().out and table in (tmp_path / "table.md").read_text()
    title, _, header, _rule, *rows = table.splitlines()
    assert title.startswith("single, 1 process(es)")
    growth = r"start [+-]\d+\.\d%, peak [+-]\d+\.\d%, live [+-]\d+\.\d%"
    assert re.search(rf"first: {growth}; second: start n/a, peak n/a, live n/a$", title)
    assert "first: peak GiB" in header and "second: peak GiB" in header and "first: peak in training GiB" in header
    assert [row.split("|")[1].strip() for row in rows] == ["0", "1", "2", "3"]
    assert rows[3].split("|")[-7:-1] == [" - "] * 6  # the second run stopped after round 1
    run = json.loads((tmp_path / "single-first.json").read_text())
    (process,) = run["processes"]
    assert [r["round"] for r in process["rounds"]] == [0, 1, 2, 3] and run["exit_status"] == 0
    # live: the start less what a trim would give back (measured in a forked copy, the process left as it is). The
    # loop gives freed memory back at each round's end, so start and live are nearly equal, and a tiny model's round
    # peaks barely above its start: the kernel's resident-memory counters, synced lazily per thread, are exact only
    # to a few hundred KiB.
    noise = 2 * 2**20
    for r in process["rounds"][1:]:
        assert r["peak"] >= max(r["peak_sampling"], r["peak_training"]) and r["peak_training"] > r["rss_start"] - noise
        assert r["rss_start"] >= r["rss_live"] - noise > 0
        assert r["earlier_trainers_alive"] == 0
    runs = json.loads((tmp_path / "provenance.json").read_text())["runs"]
    assert [r["command"].split("--label ")[1].split()[0] for r in runs] == ["first", "second"]


def test_provenance_command_records_a_command_its_log_and_kept_files(tmp_path):
    # Any command (a recipe, the GPU tests) runs through provenance.py, which records it like a benchmark's results.
    out = tmp_path / "out"
    script = (
        "from pathlib import Path; import os, sys; Path(sys.argv[1], 'kept.json').write_text('{}'); "
        "Path(sys.argv[1], 'dropped.bin').write_text('x'); "
        "print('isa', os.environ['ATEN_CPU_CAPABILITY'], sys.argv[1])"
    )
    command = [
        sys.executable,
        str(BENCHMARKS / "provenance.py"),
        str(out),
        "--keep",
        "*.json",
        "--env",
        "ATEN_CPU_CAPABILITY=avx2",
        "--",
        "python",
        "-c",
        script,
        "{work}",
    ]
    status = subprocess.run(command, capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    assert sorted(p.name for p in out.iterdir()) == ["kept.json", "log.txt", "provenance.json"]
    assert (out / "log.txt").read_text() == "isa avx2 {work}\n"  # the temporary folder's path is not kept
    (run,) = json.loads((out / "provenance.json").read_text())["runs"]
    assert run["command"].startswith("ATEN_CPU_CAPABILITY=avx2 python -c ") and run["command"].endswith(" '{work}'")
    assert run["exit_status"] == 0 and run["env"]["ATEN_CPU_CAPABILITY"] == "avx2" and run["log"] == "log.txt"
    assert run["through"] == f"python benchmarks/provenance.py {out} --keep '*.json' --env ATEN_CPU_CAPABILITY=avx2 --"
    # a failing command is recorded with its status, and the tool exits with it
    failed = subprocess.run([*command[:3], "--append", "--log", "fail.txt", "--", "python", "-c", "exit(3)"])
    assert failed.returncode == 3
    runs = json.loads((out / "provenance.json").read_text())["runs"]
    assert [r["exit_status"] for r in runs] == [0, 3] and runs[1]["log"] == "fail.txt"
    # a part run again under the same log replaces its entry; the other parts stay
    subprocess.run([*command[:3], "--append", "--log", "fail.txt", "--", "python", "-c", "exit(0)"])
    runs = json.loads((out / "provenance.json").read_text())["runs"]
    assert [(r["log"], r["exit_status"]) for r in runs] == [("log.txt", 0), ("fail.txt", 0)]


def test_gpu_kit_carries_what_the_image_lacks_or_holds_too_old_and_nothing_it_has():
    kit = load("gpu_kit")
    image = kit.read_image()
    carry, reached = kit.plan(image)
    assert {"trl", "datasets", "bitsandbytes", "dill", "multiprocess", "pyarrow"} <= carry.keys()
    assert not {"torch", "accelerate", "numpy", "tokenizers"} & carry.keys()
    # a package the image has is carried only where something carried (or trl-topr) excludes the image's version: with
    # transformers >= 5.25 (which asks huggingface-hub >= 2.4), the image's huggingface-hub 1.33, for one
    from packaging.requirements import Requirement

    required = [Requirement(r) for name in [*carry, "trl-topr"] for r in metadata.requires(name) or []]
    for name in carry.keys() & image.keys():
        assert any(
            kit.normalize(r.name) == name and not r.specifier.contains(image[name], prereleases=True) for r in required
        ), name
    assert carry["trl"] == metadata.version("trl")  # the versions the tests run with here
    # transformers: the image's is older than pyproject's lower bound, so it is carried; as new as ours, it is not
    assert image["transformers"] != metadata.version("transformers") and "transformers" in carry
    assert "transformers" not in kit.plan(image | {"transformers": metadata.version("transformers")})[0]
    assert {"torch", "accelerate"} <= reached


def test_gpu_kit_trims_a_wheel_that_still_installs(tmp_path):
    # A wheel with a library per CUDA version, trimmed to one: the files and their RECORD lines go, pip installs it.
    kit = load("gpu_kit")
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    files = {
        "demo/__init__.py": "VALUE = 1\n",
        "demo/libdemo_cuda118.so": "x" * 100,
        "demo/libdemo_cuda130.so": "y",
        "demo/libdemo_cpu.so": "z",
        "demo-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
        "demo-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        record = [f"{name},,{len(text)}" for name, text in files.items()] + ["demo-1.0.dist-info/RECORD,,"]
        archive.writestr("demo-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    kit.trim(wheel, re.compile(r"libdemo_(?!cpu|cuda130\.)\w+\.so$"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert "demo/libdemo_cuda118.so" not in names and "demo/libdemo_cuda130.so" in names
        assert "libdemo_cuda118" not in archive.read("demo-1.0.dist-info/RECORD").decode()
    # beside it, a wheel of a package the image lists and this Python holds at a newer version: not installed
    with zipfile.ZipFile(tmp_path / "tqdm-0.0.1-py3-none-any.whl", "w") as archive:
        archive.writestr("tqdm/__init__.py", "raise ImportError('the image has a newer tqdm')\n")
    # packed as the kit travels (each wheel stored, one xz archive), then installed from the archive
    archive = kit.pack(sorted(tmp_path.glob("*.whl")), tmp_path)
    assert archive.name == kit.KIT_FILE and not list(tmp_path.glob("*.whl"))
    site = tmp_path / "kit" / "site-packages"
    kit.install(tmp_path, site)
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == ["demo"]
    assert sorted(p.name for p in (site / "demo").iterdir()) == ["__init__.py", "libdemo_cpu.so", "libdemo_cuda130.so"]
    # the bitsandbytes and pyarrow rules keep what the image's torch and trl-topr load
    rules = kit.trims("130")
    kept = ["bitsandbytes/libbitsandbytes_cuda130.so", "bitsandbytes/libbitsandbytes_cpu.so"]
    kept += ["pyarrow/libarrow_python.so.2600", "pyarrow/_parquet.cpython-312-x86_64-linux-gnu.so"]
    dropped = ["bitsandbytes/libbitsandbytes_cuda128.so", "bitsandbytes/libbitsandbytes_rocm72.so"]
    dropped += ["pyarrow/libarrow_flight.so.2600", "pyarrow/_s3fs.cpython-312-x86_64-linux-gnu.so"]
    dropped += ["pyarrow/libarrow_python.so", "pyarrow/include/arrow/api.h"]
    rule = {name: rules[name.split("/")[0]] for name in kept + dropped}
    assert [bool(rule[name].search(name)) for name in kept + dropped] == [False] * len(kept) + [True] * len(dropped)


def test_the_gpu_kit_and_the_tree_travel_together_within_64_mib():
    # What travels to a GPU machine (the tracked tree and the kit, 64 MiB at most) as the kit was last built: its
    # packed size, recorded by `python benchmarks/gpu_kit.py` in benchmarks/results/gpu-kit, within what the tree
    # leaves (less a margin for the tree to grow). A larger tree (more results) or kit fails here, not on the GPU.
    kit = load("gpu_kit")
    build = (BENCHMARKS / "results" / "gpu-kit" / "build.txt").read_text()
    packed = float(re.search(r"([\d.]+) MiB packed", build).group(1))
    assert packed <= kit.kit_limit_mib(), (packed, kit.tree_mib())
    assert kit.tree_mib() + packed + kit.MARGIN_MIB <= kit.TRAVEL_MIB


def test_results_are_written_with_lists_of_plain_values_on_one_line():
    # Results files hold thousands of per-prompt counts: one a line, they took half of what travels to a GPU machine.
    dumps = load("provenance").dumps
    value = {"runs": [[{"test/correct": [0, 2, 1], "name": "a, b", "empty": {}}]], "lr": 1e-06, "tags": []}
    text = dumps(value)
    assert json.loads(text) == value
    assert '"test/correct": [0, 2, 1]' in text.splitlines()[4]
    assert len(text.splitlines()) == 13


def test_two_arms_are_paired_seed_by_seed_whichever_seeds_either_lacks(tmp_path, monkeypatch):
    # Arms that ran different seeds (one resumed elsewhere, one stopped) are paired on the seeds both ran, never by
    # position: here each seed scores its own number, so seed-by-seed pairs differ by 0 everywhere.
    report = load("report")
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "PAIRED", {})
    monkeypatch.setattr(report, "PASS_AT", {})
    folder = tmp_path / "gaps"
    settings, methods = {"seeds": 4, "k": 4, "rounds": 1}, {"a": {"lr": 1e-5}, "b": {"lr": 1e-5}}
    (folder / "runs").mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"settings": settings, "methods": methods}))
    for method, seeds in (("a", [0, 1, 2]), ("b", [0, 2, 3])):
        lines = [
            json.dumps({"method": method, "lr": 1e-5, "seed": s, "rounds": [{"test/correct": [s, s, 1]}] * 2})
            for s in seeds
        ]
        (folder / "runs" / f"{method}.jsonl").write_text("\n".join(lines) + "\n")
    assert [len(runs) for runs in report.paired_runs("gaps", "a", "b")] == [2, 2]
    difference = report.paired("gaps", "a", "b", "last")
    assert difference.estimate == 0 and difference.by_seed == [0, 0]
    (row,) = report.iterative_pass_at("gaps", [("a", "b")], ats=(4,)).splitlines()[2:]
    assert row.split("|")[4].strip() == "2" and "+0.000" in row


def test_the_stress_check_runs_the_multiprocess_tests_with_every_core_busy_and_records_a_hang(tmp_path):
    stress = load("stress")
    totals = stress.main(["--quick", "--out", str(tmp_path / "quick")])
    assert totals["runs"] == totals["passed_runs"] == 1 and totals["hung_runs"] == 0
    (run,) = [json.loads(line) for line in (tmp_path / "quick" / "runs.jsonl").read_text().splitlines()]
    assert run["burners"] == os.cpu_count() and run["summary"].startswith("1 passed")
    assert stress.main(["--quick", "--out", str(tmp_path / "quick")])["runs"] == 1  # resumed: nothing run again
    # a run past its limit is a hang: stopped (every process of it), recorded as one
    totals = stress.main(["--quick", "--limit", "3", "--out", str(tmp_path / "hang")])
    assert totals["hung_runs"] == 1 and totals["passed_runs"] == 0
    assert "1 of 1 runs passed" not in (tmp_path / "hang" / "table.md").read_text()


def test_iterative_benchmark_resumes_and_gives_every_method_the_same_budget(capsys, tmp_path):
    arms = load("arms")
    iterative = load("iterative")
    # an arm of each kind (the scale trains 14, 30 runs in --quick): the loop with and without a baseline, curated,
    # online GRPO, replay with the taper and without it
    methods = [
        "topr",
        "topr_peff0.8",
        "positives_only",
        "topr_anna_karenina",
        "grpo",
        "topr+replay",
        "reinforce+replay",
    ]
    options = ["--scale", "fast", "--quick", "--methods", *methods]
    options += ["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    ledger = tmp_path / "out" / "runs"
    iterative.main(options + ["--time_limit", "0"])  # stops after its first run, recorded in the ledger
    assert f"not finished: {', '.join(methods)}. Run the same command again" in capsys.readouterr().out
    first = (ledger / "topr.jsonl").read_text()
    assert [(e["lr"], e["seed"]) for e in map(json.loads, first.splitlines())] == [(3e-4, 0)]
    assert not (tmp_path / "work" / "topr" / "lr0.0003" / "seed1").exists()

    table = iterative.main(options)  # goes on: the first run is not redone
    assert table in capsys.readouterr().out and (ledger / "topr.jsonl").read_text().startswith(first)
    header, _rule, *rows = table.split("\n\n")[0].splitlines()
    assert [row.split("|")[1].strip() for row in rows] == methods
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    budgets = set()
    for method, entry in results["methods"].items():
        assert len(entry["runs"]) == len(entry["validation"]) == iterative.QUICK["seeds"]
        # every seed's criterion: the mean of its validation sampled pass@1 over rounds 1..R, and the last round's
        for seed, run in zip(entry["validation"], entry["runs"], strict=True):
            curve = [r["validation/pass@1"] for r in run[1:]]
            assert seed["mean"] == pytest.approx(sum(curve) / len(curve)) and seed["last"] == curve[-1]
        assert all(seconds >= 0 for seconds in entry["seconds"])
        for run in entry["runs"]:
            assert [r["round"] for r in run] == list(range(iterative.QUICK["rounds"] + 1))
            budgets.add(tuple(r["sampled_completions"] for r in run))
            assert all(
                0.0 <= r[f"{split}/pass@1{kind}"] <= 1.0
                for r in run
                for split in ("validation", "test")
                for kind in ("", "_greedy")
            )  # the fast scale evaluates both splits every round
            if method.startswith("topr"):  # the loop's training logs, per round
                assert all(0.0 <= r["train/negative_weight_share"] <= 1.0 for r in run[1:])
            # replay arms: round 2 trains on round 1's samples too, and reports them by age
            replayed = arms.ARMS[method].replay
            assert entry["replay_rounds"] == (iterative.QUICK["replay"] if replayed else 0)
            assert ("age_1/rows" in run[2]) == replayed and ("age_1/rows" in run[1]) is False
            if replayed:
                assert run[2]["age_1/rows"] == run[1]["num_train_rows"] and run[2]["num_train_rows"] == 64
    # 8 prompts x 4 samples a round, for the loop and GRPO alike (GRPO's counted by its reward function), with or
    # without replay
    assert budgets == {(0, 32, 64)}
    # every seed at the scale's extra rates too (the same-rate comparisons), outside the sweep
    assert {
        (e["lr"], e["seed"]) for e in map(json.loads, (ledger / "positives_only.jsonl").read_text().splitlines())
    } == {(3e-4, 0), (3e-4, 1), (1e-3, 0), (1e-3, 1)}
    # each test prompt's outcome, every round: the paired comparisons' data
    run = results["methods"]["topr"]["runs"][0]
    assert all(len(r["test/correct"]) == iterative.QUICK["test"] for r in run)
    assert [sum(r["test/correct"]) / iterative.QUICK["test"] for r in run] == [r["test/pass@1"] for r in run]
    # the importance weights' effective sample size and clamped fraction, per round and (replay) by sample age
    replayed = results["methods"]["topr+replay"]["runs"][0]
    assert all(0 < r["train/effective_sample_size"] <= 1 and 0 <= r["train/clamped_fraction"] <= 1 for r in run[1:])
    assert 0 < replayed[2]["age_1/effective_sample_size"] <= 1 and 0 <= replayed[2]["age_1/clamped_fraction"] <= 1
    assert (tmp_path / "out" / "iterative.png").stat().st_size > 0
    assert "negative weight share" in (tmp_path / "out" / "diagnosis.md").read_text()
    efficiency = (tmp_path / "out" / "efficiency.md").read_text().split("\n\n")[1].splitlines()[2:]
    assert [row.split("|")[1].strip() for row in efficiency] == methods
    ages = (tmp_path / "out" / "ages.md").read_text().split("\n\n")[1].splitlines()[2:]
    assert {(row.split("|")[1].strip(), row.split("|")[3].strip()) for row in ages} == {
        (method, age) for method in methods if arms.ARMS[method].replay for age in "01"
    }
    sweep_rows = (tmp_path / "out" / "sweep.md").read_text().split("\n\n")[1].splitlines()[2:]
    swept = [row.split("|")[1].strip() for row in sweep_rows]  # one rate each in --quick, and the extra rate
    assert list(dict.fromkeys(swept)) == methods and swept.count("positives_only") == 2

    # --report_only: the ledger's runs again, nothing trained (a method without a ledger is left out)
    (ledger / "grpo.jsonl").unlink()
    shutil.rmtree(tmp_path / "work")
    partial = iterative.main(options + ["--report_only"])
    assert [row for row in partial.split("\n\n")[0].splitlines()[2:]] == [
        row for row in table.split("\n\n")[0].splitlines()[2:] if "| grpo |" not in row
    ]
    assert not (tmp_path / "work" / "grpo").exists()
    # each call that wrote the results is recorded: the results accumulate over calls (and commits)
    runs = json.loads((tmp_path / "out" / "provenance.json").read_text())["runs"]
    command = "python benchmarks/iterative.py " + " ".join(options)
    assert [run["command"] for run in runs] == [f"{command} --time_limit 0", command, f"{command} --report_only"]
    iterative.main(options + ["--report_only"])  # the same command again is another call: recorded again
    runs = json.loads((tmp_path / "out" / "provenance.json").read_text())["runs"]
    assert [run["command"] for run in runs][2:] == [f"{command} --report_only"] * 2


def test_iterative_sweep_climbs_the_grid_and_stops_past_the_peak():
    search = load("search")
    scores = {1e-6: 0.1, 3e-6: 0.2, 1e-5: 0.5, 3e-5: 0.7, 1e-4: 0.6, 3e-4: 0.9, 1e-3: 0.95}
    trained = []

    def score(rate):
        trained.append(rate)
        return scores[rate]

    grid = [3e-4, 1e-4, 3e-5, 1e-5]
    assert search.climb(grid, score, done=lambda rate: False) == {1e-5: 0.5, 3e-5: 0.7, 1e-4: 0.6}
    assert trained == [1e-5, 3e-5, 1e-4]  # ascending; 3e-4 is past the peak, not trained
    # a finished run past the peak is still read; its best at the grid's top edge asks for rates beyond it
    scores[3e-3] = 0.2
    assert search.climb(grid, scores.get, done=lambda rate: rate == 3e-4) == {
        1e-5: 0.5,
        3e-5: 0.7,
        1e-4: 0.6,
        3e-4: 0.9,
        1e-3: 0.95,
        3e-3: 0.2,
    }
    # a best past the edge is followed while it stays at the edge, up to PAST_EDGE rates beyond the grid
    descending = {rate: -rate for rate in [1e-7, 3e-7, 1e-6, 3e-6, 1e-5]}
    assert search.PAST_EDGE == 2
    assert search.climb([3e-6, 1e-5], descending.get, done=lambda rate: False) == {
        3e-6: -3e-6,
        1e-5: -1e-5,
        1e-6: -1e-6,
        3e-7: -3e-7,
    }
    turns = {1e-6: 0.4, 3e-6: 0.5, 1e-5: 0.3}  # the first rate past the edge scores lower: the sweep ends there
    assert search.climb([3e-6, 1e-5], turns.get, done=lambda rate: False) == {3e-6: 0.5, 1e-5: 0.3, 1e-6: 0.4}
    assert search.climb([3e-4], scores.get, done=lambda rate: False) == {3e-4: 0.9}  # one rate: no sweep
    assert search.climb(grid, lambda rate: None if rate == 3e-5 else scores[rate], lambda rate: False) is None
    assert [search.beyond(rate, up) for rate, up in [(1e-5, False), (3e-6, False), (3e-5, True), (1e-3, True)]] == [
        3e-6,
        1e-6,
        1e-4,
        3e-3,
    ]


def test_iterative_sample_efficiency_counts_completions_to_the_first_round_at_a_threshold():
    report = load("iterative_report")
    ledger = load("ledger")
    run = [
        {"sampled_completions": 0, "test/pass@1": 0.5},
        {"sampled_completions": 512, "test/pass@1": 0.85},
        {"sampled_completions": 1024, "test/pass@1": 0.79},
        {"sampled_completions": 1536, "test/pass@1": 0.9},
    ]
    assert report.first_reaching(run, 0.8) == 512 and report.first_reaching(run, 0.9) == 1536
    assert report.first_reaching(run, 0.95) is None
    # a scale whose model starts low sets its thresholds as gains over the start (the mean of every run's round 0)
    other = [{**r, "test/pass@1": r["test/pass@1"] - 0.3} for r in run]  # 0.2, 0.55, 0.49, 0.6: the start is 0.35
    results = {"settings": {"rounds": 3, "gains": [0.3, 0.5]}, "methods": {"topr": {"lr": 1e-5, "runs": [run, other]}}}
    header, _, row = report.efficiency_table(results).split("\n\n")[0].splitlines()
    assert "to 0.650 (start + 0.3)" in header and "to 0.850 (start + 0.5)" in header
    assert row == "| topr | 1e-05 | 512 / - | 512 / - |"
    results["settings"] = {"rounds": 3, "thresholds": [0.8, 0.9]}  # or absolute thresholds
    assert report.efficiency_table(results).splitlines()[2] == "| topr | 1e-05 | 512 / - | 1536 / - |"
    assert ledger.validation_scores(
        [
            {"validation/pass@1": 0.9, "validation/pass@1_greedy": 1.0},
            {"validation/pass@1": 0.2},
            {"validation/pass@1": 0.6, "validation/pass@1_greedy": 0.5},
        ]
    ) == {"mean": pytest.approx(0.4), "last": 0.6, "greedy_last": 0.5}  # round 0 is not in the mean


def test_iterative_replay_arms_score_every_rate_of_their_grid():
    search = load("search")
    ledger = load("ledger")
    # the same-rate table: a replay arm's sweep does not stop past its peak; an on-policy arm's does
    setting = {"lrs": [1e-5, 1e-4, 3e-4], "replay_lrs": [1e-5, 1e-4, 3e-4], "sweep_seeds": 2, "past_edge": 0}
    peak = {1e-5: 0.5, 1e-4: 0.7, 3e-4: 0.6}
    empty = ledger.Ledger(Path("/nonexistent"))
    assert search.sweep(setting, "topr+replay", peak.get, empty) == peak
    assert search.sweep(setting, "topr", {**peak, 1e-4: 0.4}.get, empty) == {1e-5: 0.5, 1e-4: 0.4}
    # a scale without the same-rate table: the replay arms climb too
    climbing = {**setting, "replay_every_rate": False}
    assert search.sweep(climbing, "topr+replay", {**peak, 1e-4: 0.4}.get, empty) == {1e-5: 0.5, 1e-4: 0.4}


def test_iterative_ledger_trains_again_a_run_whose_line_was_cut_short(tmp_path, capsys):
    ledgers = load("ledger")
    runs = tmp_path / "runs"
    runs.mkdir()
    whole = json.dumps({"method": "topr", "lr": 1e-5, "seed": 0, "seconds": 3})
    (runs / "topr.jsonl").write_text(whole + "\n" + whole.replace('"seed": 0', '"seed": 1')[:30])
    ledger = ledgers.Ledger(tmp_path)
    assert ledger.get("topr", 1e-5, 0)["seconds"] == 3 and ledger.get("topr", 1e-5, 1) is None
    assert "cut short" in capsys.readouterr().err
    (runs / "topr.jsonl").write_text(whole[:30] + "\n" + whole + "\n")  # cut short before the end: not a killed write
    with pytest.raises(json.JSONDecodeError):
        ledgers.Ledger(tmp_path)


@pytest.mark.parametrize("scale", ["fast", "real"])
def test_iterative_results_follow_the_sweep(scale):
    search = load("search")
    arms = load("arms")
    # The committed results hold every rate the sweep asks for, and its best rate is the one each method ran.
    results = json.loads((BENCHMARKS / "results" / f"iterative-{scale}" / "results.json").read_text())
    sweeps = {
        method: {float(rate): value for rate, value in entry["sweep"].items()}
        for method, entry in results["methods"].items()
    }
    assert sorted(sweeps) == sorted(results["settings"].get("methods") or arms.ARMS)
    for method, recorded in sweeps.items():
        swept = search.climb(
            search.grid(results["settings"], method),
            recorded.get,
            done=lambda rate, method=method, recorded=recorded: (
                (arms.ARMS[method].replay and results["settings"].get("replay_every_rate", True)) or rate in recorded
            ),
            past_edge=results["settings"]["past_edge"],
        )
        assert swept == recorded and search.best_rate(swept) == results["methods"][method]["lr"], method
        assert len(results["methods"][method]["runs"]) == results["settings"]["seeds"], method


def test_paired_differences_read_above_below_or_tied_from_their_interval():
    paired = load("paired")

    def run(correct_by_round: list[list[int]], k: int = 4) -> list[dict]:
        return [{"test/correct": c, "test/pass@1": sum(c) / (k * len(c))} for c in correct_by_round]

    # 3 seeds x 40 prompts: arm A one sample better than B on every prompt at round 2, the same at round 1
    base = [[i % 5 for i in range(40)] for _ in range(3)]
    first = [run([b, b, [min(c + 1, 4) for c in b]]) for b in base]
    second = [run([b, b, b]) for b in base]
    difference = paired.paired_difference(first, second, rounds=[2], k=4)
    gain = sum(min(c + 1, 4) - c for c in base[0]) / (4 * 40)
    assert difference.estimate == pytest.approx(gain) and difference.by_seed == pytest.approx([gain] * 3)
    assert 0 < difference.low <= difference.estimate <= difference.high and difference.reading == "above"
    assert paired.paired_difference(second, first, rounds=[2], k=4).reading == "below"
    # over rounds 1-2 the gain is halved; the seeds' and prompts' spread widens the interval, it stays above 0
    area = paired.paired_difference(first, second, rounds=[1, 2], k=4)
    assert area.estimate == pytest.approx(gain / 2) and area.reading == "above"
    # a difference that changes sign from prompt to prompt: tied
    noisy = [run([[c + (1 if i % 2 else -1) if 0 < c < 4 else c for i, c in enumerate(b)]] * 3) for b in base]
    tied = paired.paired_difference(noisy, second, rounds=[2], k=4)
    assert tied.low < 0 < tied.high and tied.reading == "tied"
    # the same runs give the same interval (the draws are seeded), and unpaired runs are refused
    assert paired.paired_difference(noisy, second, rounds=[2], k=4) == tied
    with pytest.raises(ValueError, match="paired runs"):
        paired.paired_difference(noisy[:2], second, rounds=[2], k=4)
    with pytest.raises(ValueError, match="per-prompt"):
        paired.paired_difference([[{}, {}, {"test/pass@1": 0.5}]] * 3, second, rounds=[2], k=4)


def test_iterative_bracket_ends_with_an_interior_best_and_references_take_its_rate(tmp_path):
    search = load("search")
    iterative = load("iterative")
    ledger = load("ledger")
    # down first from the start; past the edge that holds the best until a worse rate stands on each side
    peak_low = {1e-7: 0.1, 3e-7: 0.2, 1e-6: 0.4, 3e-6: 0.3, 1e-5: 0.1}
    trained = []

    def score(rate):
        trained.append(rate)
        return peak_low[rate]

    assert search.bracket(3e-6, score) == {3e-6: 0.3, 1e-6: 0.4, 3e-7: 0.2}
    assert trained == [3e-6, 1e-6, 3e-7] and search.interior({3e-6: 0.3, 1e-6: 0.4, 3e-7: 0.2})
    peak_high = {1e-6: 0.1, 3e-6: 0.2, 1e-5: 0.3, 3e-5: 0.5, 1e-4: 0.4}
    assert list(search.bracket(3e-6, peak_high.get)) == [3e-6, 1e-6, 1e-5, 3e-5, 1e-4]
    assert list(search.bracket(3e-6, {1e-6: 0.1, 3e-6: 0.2, 1e-5: 0.1}.get)) == [3e-6, 1e-6, 1e-5]
    # ties go to the smaller rate, so a tie below the start goes on down; a search that never turns stops at `most`
    assert list(search.bracket(3e-6, {1e-6: 0.3, 3e-6: 0.3, 3e-7: 0.1}.get)) == [3e-6, 1e-6, 3e-7]
    assert len(search.bracket(3e-6, lambda rate: -rate, most=4)) == 4
    assert search.bracket(3e-6, lambda rate: None) is None

    # the scale's protocol, its training replaced by a table of criteria: each swept arm bracketed on the sweep
    # seeds, every seed at its best, the reference arms at their reference's best rate, on every seed
    setting = dict(iterative.SCALES["real-v2"], methods=["positives_only", "topr_peff0.8+replay", "topr+replay"])
    criteria = {"positives_only": peak_low, "topr_peff0.8+replay": peak_high}
    runs = iterative.Runs(setting, ledger.Ledger(tmp_path), tmp_path, setting["methods"], iterative.parse_args([]))
    runs.run = lambda method, lr, seed: {
        "validation": {"mean": criteria.get(method, {}).get(lr, 0.0)},
        "rounds": [],
        "seconds": 0,
    }
    results = runs.results()["methods"]
    assert (results["positives_only"]["lr"], results["topr_peff0.8+replay"]["lr"]) == (1e-6, 3e-5)
    assert results["topr+replay"]["lr"] == 3e-5 and results["topr+replay"]["sweep"] == {}
    assert results["topr+replay"]["reference"] == "topr_peff0.8+replay"
    assert all(len(entry["runs"]) == setting["seeds"] for entry in results.values())
    plan = search.plan(setting, setting["methods"], ledger.Ledger(tmp_path))
    assert "a bracket from 3e-6, down first, of 3 rates or more" in plan
    assert "at the best rate of topr_peff0.8+replay, not swept" in plan
    # a bracket that took a fourth rate counts the runs it took, not the three rates' minimum; one whose best is at
    # the edge of its three rates counts the fourth rate it runs next
    validation = {3e-6: 0.30, 1e-6: 0.29, 1e-5: 0.32, 3e-5: 0.20}  # up past 3e-6, then 1e-5 is interior
    edge, taken = ledger.Ledger(tmp_path / "edge"), ledger.Ledger(tmp_path / "taken")
    for lr, seed in [(lr, seed) for lr in (3e-6, 1e-6, 1e-5, 3e-5) for seed in (0, 1)] + [(1e-5, 2)]:
        entry = {"method": "positives_only", "lr": lr, "seed": seed, "seconds": 60, "resumed": False}
        taken.add(dict(entry, validation={"mean": validation[lr]}))
        if lr != 3e-5 and seed < 2:
            edge.add(dict(entry, validation={"mean": validation[lr]}))
    (arm,) = search.estimate(setting, ["positives_only"], taken)
    assert (arm["runs"], arm["done"], arm["hours"]) == (9, 9, 0)
    (arm,) = search.estimate(setting, ["positives_only"], edge)
    assert (arm["runs"], arm["done"]) == (9, 6) and arm["hours"] == 3 * 60 / 3600


def test_staleness_benchmark_gives_every_arm_the_same_budget_and_counts_what_it_drops(capsys, tmp_path):
    # The quick protocol end to end: every arm at lags 0 and 8 on two seeds, each sampling the same budget and
    # evaluated at the same marks; the rates chosen on a seed the readings do not take, on steps of about 2, and
    # scored again at lag 8; TRL's arm as its worker runs: its runs serve `trl+keep` at lag 0 (nothing is old enough
    # to drop), and at lag 8 its samples are trained at its bound, 4, none dropped
    staleness = load("staleness")
    out = tmp_path / "out"
    staleness.main(["--quick", "--work", str(tmp_path / "work"), "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert set(results["arms"]) == {f"{arm}@{lag}" for arm in staleness.ARMS for lag in (0, 8)}
    quick = staleness.QUICK
    for arm in results["arms"].values():
        assert len(arm["runs"]) == quick["seeds"]
        for run in arm["runs"]:
            assert [c["samples"] for c in run] == list(range(0, quick["budget"] + 1, quick["every"]))
            assert len(run[-1]["test/correct"]) == quick["test"] and run[-1]["dropped"] == 0
    assert results["arms"]["trl+keep@0"]["runs"] == results["arms"]["trl@0"]["runs"]
    assert results["arms"]["trl@8"]["trained_lag"] == 4 and (out / "runs" / "trl-lag4.jsonl").exists()
    assert not (out / "runs" / "trl-lag8.jsonl").exists()
    sweep = {json.loads(line)["seed"] for path in (out / "runs").glob("*lag0.jsonl") for line in path.open()}
    assert set(quick["sweep_seeds"]) <= sweep and set(quick["sweep_seeds"]).isdisjoint(range(quick["seeds"]))
    for arm, rates in results["rates"].items():
        scored = sorted(float(rate) for rate in rates["scores"])
        assert all(0.35 <= low / high <= 0.55 for low, high in zip(scored, scored[1:])), (arm, scored)  # 1-2-5
        assert len(rates["scores_at_lag_8"]) == 3 and rates["best_at_lag_8"] > 0
    readings = (out / "readings.md").read_text()
    for other in ("reinforce", "tis", "positives_only", "trl", "trl+keep"):
        assert f"| 8 | {other} |" in readings
    assert "(seeds [" in readings and " of 2 |" in readings  # both intervals, and the collapsed runs counted
    entry = json.loads((out / "runs" / "topr-lag0.jsonl").read_text().splitlines()[0])
    assert entry["command"].startswith("python benchmarks/staleness.py --quick") and entry["commit"]
    check_provenance(
        out, "python benchmarks/staleness.py --quick --work " + str(tmp_path / "work") + " --out " + str(out)
    )


def test_staleness_scarce_start_plans_its_own_arms_and_lags(tmp_path):
    # `--start scarce`: TOPR, REINFORCE with the target and positives-only at lags 0 and 8, from a reverser trained
    # fewer steps, into a ledger of its own
    staleness = load("staleness")
    text = staleness.main(["--start", "scarce", "--plan", "--out", str(tmp_path)])
    scarce = staleness.SCARCE
    sweep, arms = len(staleness.SETTING["sweep_seeds"]), len(scarce["arms"])
    runs = 3 * sweep * arms + 2 * sweep * arms + arms * len(scarce["lags"]) * staleness.SETTING["seeds"]
    assert text.startswith(f"At least {runs} runs") and scarce["pretrain_steps"] < 130


def test_the_seed_level_interval_is_students_t():
    paired = load("paired")
    assert round(paired.t_quantile(0.975, 4), 3) == 2.776 and round(paired.t_quantile(0.975, 30), 3) == 2.042
    low, high = paired.seed_interval([0.1, 0.2, 0.3])
    assert round(low, 4) == round(0.2 - 4.303 * 0.1 / 3**0.5, 4) and round(high, 4) == round(
        0.2 + 4.303 * 0.1 / 3**0.5, 4
    )
    difference = paired.Difference(0.02, 0.01, 0.03, [0.05, -0.01])  # the bootstrap excludes 0, the seeds do not
    assert difference.bootstrap_reading == "above" and difference.reading == "tied"
    assert difference.text() == "+0.020 [+0.010, +0.030] (seeds [-0.361, +0.401])"
    # a difference of two rates lies in [-1, +1], and so does its seed-level interval, however few the seeds
    wide = paired.Difference(0.7, 0.5, 0.9, [0.9, 1.0, 0.2])
    assert paired.seed_interval([0.9, 1.0, 0.2])[1] > 1 and wide.seed_interval()[1] == 1.0
    assert wide.text().endswith("(seeds [-0.383, +1.000])")


def test_per_prompt_scores_divide_by_the_samples_each_round_drew():
    # a round that drew 16 test samples a prompt (`--last_test_samples`) beside rounds of k = 4
    paired = load("paired")
    run = [{"test/correct": [4, 0]}, {"test/correct": [8, 16], "test/samples": 16}]
    assert paired.prompt_scores(run, [0], 4) == [1.0, 0.0]
    assert paired.prompt_scores(run, [1], 4) == [0.5, 1.0]
    assert paired.prompt_scores(run, [0, 1], 4) == [0.75, 0.5]
    # pass@k, unbiased: 4 right of 16, pass@4 = 1 - C(12, 4) / C(16, 4); every sample right or none, 1 or 0
    assert paired.pass_at(16, 4, 4) == pytest.approx(1 - 495 / 1820) and paired.pass_at(4, 1, 4) == 1.0
    assert paired.prompt_scores(run, [1], 4, at=16) == [1.0, 1.0] and paired.pass_at(16, 0, 16) == 0.0
    with pytest.raises(ValueError, match="pass@16 needs at least 16 samples a prompt; the round drew 4"):
        paired.prompt_scores(run, [0], 4, at=16)


def test_iterative_seeds_option_plans_more_seeds_beside_the_committed_results(tmp_path, capsys):
    # `--seeds` adds seeds at each arm's best rate in place of the scale's, into another folder (`--out`): the plan
    # counts the seeds up to the new last one, and the scale's own setting is left as it is
    iterative = load("iterative")
    seeds = iterative.SCALES["fast"]["seeds"]
    text = iterative.main(["--scale", "fast", "--seeds", str(seeds + 5), "--out", str(tmp_path), "--plan"])
    assert f"then seeds up to {seeds + 4} at the best" in text
    assert iterative.SCALES["fast"]["seeds"] == seeds
    assert f"then seeds up to {seeds - 1} at the best" in iterative.main(["--out", str(tmp_path), "--plan"])


def test_iterative_skip_seeds_leaves_those_seeds_to_another_call_of_the_same_arm(tmp_path):
    # two calls of one arm train its missing seeds in order, so both would pick the first: `--skip_seeds` leaves some
    # to the other call; a seed the ledger has stays available (read, not trained)
    iterative = load("iterative")
    ledger = load("ledger").Ledger(tmp_path)
    ledger.add({"method": "positives_only", "lr": 1e-5, "seed": 0})
    argv = ["--scale", "fast", "--methods", "positives_only", "--time_limit", "1"]

    def available(*extra):
        args = iterative.parse_args([*argv, *extra])
        runs = iterative.Runs({}, ledger, tmp_path / "work", args.methods, args)
        return [runs.available("positives_only", 1e-5, seed) for seed in range(4)]

    assert available() == [True, True, True, True]
    assert available("--skip_seeds", "0", "1", "2") == [True, False, False, True]


def test_iterative_plan_counts_only_the_seeds_this_call_trains(tmp_path):
    # `--plan` with `--skip_seeds`: the runs and the runs done leave out the seeds another call trains
    iterative = load("iterative")
    ledger = load("ledger").Ledger(tmp_path)
    setting = iterative.SCALES["fast"]
    argv = ["--scale", "fast", "--methods", "positives_only", "--out", str(tmp_path), "--plan"]
    for seed in (0, setting["seeds"] - 1):  # a sweep seed and a seed run at the best rate only, both done
        ledger.add({"method": "positives_only", "lr": 1e-5, "seed": seed, "seconds": 60, "resumed": False})

    def counts(text):
        return [int(n) for n in re.search(r"(\d+) runs, (\d+) done", text).groups()]

    (runs, done) = counts(iterative.main(argv))
    last = setting["seeds"] - 1
    assert done == 2
    skipped = iterative.main([*argv, "--skip_seeds", "0", str(last)])
    search = load("search")
    grid_runs = len(search.grid(setting, "positives_only")) + setting.get("past_edge", search.PAST_EDGE)
    assert counts(skipped) == [runs - grid_runs - 1, 0]
    assert f"Seeds 0 {last} left to another call" in skipped


def test_iterative_last_test_round_samples_as_many_as_asked_for_pass_at_k(tmp_path):
    # `--last_test_samples`: where the test split is evaluated at `test_rounds`, the last round draws that many samples
    # a prompt (its per-prompt counts read pass@k up to it) and the earlier rounds the scale's k; each line says which
    iterative = load("iterative")
    work, folder = tmp_path / "work", tmp_path / "run"
    setting = dict(iterative.setup("fast", work, quick=True), rounds=1, test_rounds=[0, 1], last_test_samples=3)
    prompts = len(setting["test"])
    shutil.copytree(setting["model"], folder / "round-1")  # the last round's model: the start's, for the test
    iterative.evaluate_test(setting, folder, 0, work, use_vllm=False)
    lines = [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()]
    assert [(line["round"], line["samples"]) for line in lines] == [(0, setting["k"]), (1, 3)]
    for line in lines:
        assert len(line["correct"]) == prompts and all(0 <= c <= line["samples"] for c in line["correct"])
        assert line["pass@1"] == pytest.approx(sum(line["correct"]) / (prompts * line["samples"]))
    with pytest.raises(ValueError, match="--last_test_samples: the fast scale evaluates the test split every round"):
        iterative.main(["--scale", "fast", "--last_test_samples", "16", "--out", str(tmp_path / "out"), "--plan"])


def _append_records(folder: str, writer: int, count: int) -> None:
    provenance = load("provenance")
    for i in range(count):
        provenance.record(folder, {"command": f"writer {writer} call {i}"}, append=True)


def test_calls_that_end_together_each_keep_their_record(tmp_path):
    # Two calls of one benchmark that split its seeds (`iterative.py --skip_seeds`) can end within the same second, and
    # each appends its entry to the folder's provenance.json: none may be lost, and the file stays one JSON document.
    import multiprocessing

    writers, count = 6, 25
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_append_records, args=(str(tmp_path), w, count)) for w in range(writers)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=120)
        assert p.exitcode == 0
    runs = json.loads((tmp_path / "provenance.json").read_text())["runs"]
    assert sorted(run["command"] for run in runs) == sorted(
        f"writer {w} call {i}" for w in range(writers) for i in range(count)
    )


def test_denormals_benchmark_puts_the_trainer_as_shipped_beside_it_with_denormals_kept(capsys, tmp_path):
    table = load("denormals").main(["--quick", "--reps", "1", "--out", str(tmp_path)])
    assert table in capsys.readouterr().out
    _header, _rule, seconds = table.splitlines()
    results = json.loads((tmp_path / "results.json").read_text())
    runs = results["runs"]
    # each setting trained as it says, every step: the trainer as shipped flushes, the other keeps
    assert [run["flushing"] for run in runs["flushed"]] == [[True] * 4]
    assert [run["flushing"] for run in runs["kept"]] == [[False] * 4]
    assert results["rows"] == 16 and len(results["log_ratio_mean"]) == 4 and results["checkpointing"] is True
    median = results["median_seconds"]
    assert results["seconds_ratio"] == pytest.approx(median["kept"] / median["flushed"])
    assert seconds.split("|")[-2].strip() == f"{results['seconds_ratio']:.2f}"
    assert results["same_losses"] == (runs["flushed"][0]["losses"] == runs["kept"][0]["losses"])
    check_provenance(tmp_path, f"python benchmarks/denormals.py --quick --reps 1 --out {tmp_path}")
