"""The GPU kit: the wheels a GPU machine's image lacks, built ahead, installed there in seconds.

A GPU machine starts from an image with torch, transformers and much of the scientific stack (`gpu_image.txt`)
but without trl, datasets or bitsandbytes, and nothing can be downloaded there. This script builds, on a machine
that can reach the package index, a wheelhouse of exactly what a trl-topr install needs beyond the image, at the
versions installed where it runs (the ones the tests passed with), in wheels for the image's Python. It trims the
two large ones to what runs there (pyarrow without Flight and the cloud file systems, bitsandbytes with the image's
CUDA only) and packs the wheels, each stored uncompressed, into one xz archive (`kit.tar.xz`: xz over the stored files
compresses about twice what each wheel's own deflate does), so that the kit travels with the working tree within
64 MiB: the kit's limit is what the tree leaves of them. On the GPU machine, `gpu.sh` installs it
into a folder of its own whose path contains `site-packages` (so `torch.compile` treats the libraries as libraries,
not as user code), ahead of the image's packages on the path; torch and the CUDA libraries stay the image's.

    python benchmarks/gpu_kit.py                    # build .whl/ for the image (Python 3.12, CUDA 13.0)
    python benchmarks/gpu_kit.py --rehearse         # and rehearse the install here: a fresh venv with torch and the
                                                    # image's packages, the kit built for this Python, gpu.sh's setup
                                                    # and its rehearsal part
    python benchmarks/gpu_kit.py --install .whl --site DIR/site-packages   # on the GPU machine (gpu.sh does it)
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

import tomllib


ROOT = Path(__file__).resolve().parents[1]
IMAGE = Path(__file__).with_name("gpu_image.txt")
TRAVEL_MIB = 64  # what travels to a GPU machine: the working tree and the kit together
MARGIN_MIB = 4  # room for the tree to grow between two builds of the kit
KIT_FILE = "kit.tar.xz"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64")
PLATFORMS += ("manylinux2014_x86_64", "manylinux1_x86_64")
EXTRAS = ("quantization",)  # bitsandbytes, for the QLoRA checks
TEST_TOOLS = {"pytest", "hypothesis"}  # what the GPU tests need beyond the install, in the image


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_image(path: Path = IMAGE) -> dict[str, str | None]:
    """The image's packages, `{normalized name: version or None when not read}`."""
    packages = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            packages[normalize(name)] = version or None
    return packages


def plan(image: dict[str, str | None], python: str = "3.12") -> tuple[dict[str, str], set[str]]:
    """
    What to carry: `{name: version}` for every distribution a trl-topr install reaches that the image lacks or holds
    at a version its requirement excludes, at the version installed here; and the image's packages it reached.

    Walks the requirements from `pyproject.toml` (with `EXTRAS`) through the installed distributions' metadata,
    with markers evaluated for Linux x86-64 and `python`; it stops at what the image satisfies.
    """
    from packaging.requirements import Requirement

    environment = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux"}
    environment |= {"platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython"}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pending = [Requirement(r) for r in project["dependencies"]]
    pending += [Requirement(r) for extra in EXTRAS for r in project["optional-dependencies"][extra]]
    carry, reached = {}, set()
    while pending:
        requirement = pending.pop()
        name = normalize(requirement.name)
        if requirement.marker and not requirement.marker.evaluate(environment | {"extra": ""}):
            continue
        if name in image and (image[name] is None or requirement.specifier.contains(image[name], prereleases=True)):
            reached.add(name)
            continue
        if name in carry:
            continue
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} ({requirement}) is not installed here: install trl-topr's extras") from None
        if not requirement.specifier.contains(version, prereleases=True):
            raise SystemExit(f"{name} {version} is installed here, but {requirement} is required")
        carry[name] = version
        pending += [Requirement(r) for r in metadata.requires(name) or []]
    return dict(sorted(carry.items())), reached


def trim(wheel: Path, drop: re.Pattern) -> None:
    """Rewrite `wheel` without the files whose path matches `drop`, and without their lines of its RECORD."""
    trimmed = wheel.with_suffix(".trimmed")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            if drop.search(item.filename):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not drop.search(line.split(",")[0])).encode()
            target.writestr(item, data, compress_type=zipfile.ZIP_DEFLATED)
    trimmed.replace(wheel)


def trims(cuda: str) -> dict[str, re.Pattern]:
    """What each large wheel loses: pyarrow's Flight, cloud file systems, headers and tests, the copies of its
    Python libraries under other names; bitsandbytes' libraries for other CUDA versions, ROCm and XPU."""
    return {
        "pyarrow": re.compile(
            r"^pyarrow/(include|src|tests)/|flight|_s3|_azurefs|_gcsfs|_hdfs|_pyarrow_cpp_tests"
            r"|libarrow_python(_parquet_encryption)?\.so(\.\d+\.\d+\.\d+)?$"
        ),
        "bitsandbytes": re.compile(rf"libbitsandbytes_(?!cpu|cuda{cuda}\.)\w+\.so$"),
    }


def tree_mib(root: Path = ROOT) -> float:
    """What of the working tree travels to a GPU machine: its tracked files and the untracked ones git does not
    ignore, in MiB."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    files = [root / name.decode() for name in listed if name]
    return sum(path.stat().st_size for path in files if path.is_file() and not path.is_symlink()) / 2**20


def kit_limit_mib(root: Path = ROOT) -> float:
    """What the working tree leaves the kit of the 64 MiB that travel, less a margin for the tree to grow."""
    return TRAVEL_MIB - tree_mib(root) - MARGIN_MIB


def stored(wheel: Path) -> None:
    """Rewrite `wheel` with its files stored uncompressed (still a wheel pip installs), for one xz over all of them."""
    rewritten = wheel.with_suffix(".stored")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(rewritten, "w", zipfile.ZIP_STORED) as target:
        for item in source.infolist():
            target.writestr(item, source.read(item), compress_type=zipfile.ZIP_STORED)
    rewritten.replace(wheel)


def pack(wheels: list[Path], out: Path) -> Path:
    """The wheels, stored uncompressed, in one xz archive `out/kit.tar.xz` (the wheels themselves removed)."""
    archive = out / KIT_FILE
    with tarfile.open(archive, "w:xz", preset=9) as packed:
        for wheel in wheels:
            stored(wheel)
            packed.add(wheel, arcname=wheel.name)
    for wheel in wheels:
        wheel.unlink()
    return archive


def build(out: Path, python: str, cuda: str, limit_mib: float | None = None) -> Path:
    """Download the planned wheels for `python` to `out` (emptied first), trim them and pack them into
    `out/kit.tar.xz`; fail above `limit_mib` (by default what the working tree leaves, [`kit_limit_mib`])."""
    limit_mib = kit_limit_mib() if limit_mib is None else limit_mib
    carry, _ = plan(read_image(), python)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    platforms = [f"--platform={p}" for p in PLATFORMS]
    command = [sys.executable, "-m", "pip", "download", "-qq", "--no-deps", "--only-binary=:all:", "-d", str(out)]
    command += ["--python-version", python, "--implementation", "cp", *platforms]
    subprocess.run(command + [f"{name}=={version}" for name, version in carry.items()], check=True)
    wheels = sorted(out.glob("*.whl"))
    for wheel in wheels:
        drop = trims(cuda).get(normalize(wheel.name.split("-")[0]))
        if drop:
            trim(wheel, drop)
    sizes = {wheel.name: wheel.stat().st_size / 2**20 for wheel in wheels}
    for name, size in sizes.items():
        print(f"{size:7.2f} MiB  {name}")
    archive = pack(wheels, out)
    total = archive.stat().st_size / 2**20
    print(f"{sum(sizes.values()):7.2f} MiB in {len(wheels)} wheels")
    print(f"{total:7.2f} MiB packed ({KIT_FILE}; limit {limit_mib:.1f} MiB: the tree takes {tree_mib():.1f} of 64)")
    if total > limit_mib:
        raise SystemExit(f"the kit takes {total:.1f} MiB, more than {limit_mib:.1f}")
    return archive


def install(wheelhouse: Path, site: Path) -> None:
    """
    Install the kit's wheels (packed in `kit.tar.xz`, or as they are) into `site`, without dependencies and from the
    kit alone, skipping a wheel whose distribution the running Python already holds at its version or newer where
    `gpu_image.txt` lists it (one it does not list, such as pyarrow, is always installed: the image's may not work);
    then check that torch stays the one outside `site`.
    """
    from packaging.version import InvalidVersion, Version

    if (wheelhouse / KIT_FILE).exists():  # packed: unpacked into a folder of its own first
        unpacked = Path(tempfile.mkdtemp(prefix="gpu-kit-"))
        with tarfile.open(wheelhouse / KIT_FILE) as packed:
            packed.extractall(unpacked, filter="data")
        wheelhouse = unpacked
    image, wanted = read_image(), []
    for wheel in sorted(wheelhouse.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        try:
            have = metadata.version(name) if normalize(name) in image else None
            newer = have is not None and Version(have) >= Version(version)
        except (metadata.PackageNotFoundError, InvalidVersion):
            newer = False
        if newer:
            print(f"kit: {name} {have} already installed, {version} not needed")
        else:
            wanted.append(str(wheel))
    site.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "install", "-qq", "--no-index", "--no-deps", "--no-compile"]
    if wanted:
        subprocess.run(command + ["--no-cache-dir", "--upgrade", "--target", str(site), *wanted], check=True)
    for name in ("torch", "triton", "nvidia"):
        if (site / name).exists():
            raise SystemExit(f"the kit installed {name} into {site}: it must come from the image")
    print(f"kit: {len(wanted)} wheels installed into {site}")


def rehearse(work: Path, cuda: str) -> None:
    """
    Rehearse the GPU install here: a fresh venv holding torch and, at the versions `gpu_image.txt` gives (or the
    newest below them this Python has), the image's packages a trl-topr install reaches and pytest; the kit built
    for this Python; then what `gpu.sh` does before its parts (install, path, versions), and a quick CPU run
    through trl, datasets and bitsandbytes.
    """
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    venv = work / "venv"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-qq"]
    subprocess.run(pip + [f"torch=={metadata.version('torch').split('+')[0]}"], check=True)
    image = read_image()
    _, reached = plan(image, python)
    reached = (reached - {"torch"}) | (TEST_TOOLS & image.keys())
    # the image's version, or the newest below it where this Python has no wheel of it (numpy 2.5 needs 3.12)
    pins = [f"{name}<={image[name]}" if image[name] else name for name in sorted(reached)]
    subprocess.run(pip + [*pins, f"torch=={metadata.version('torch').split('+')[0]}"], check=True)
    seconds = time.perf_counter() - start
    print(f"rehearsal: a venv with torch and {len(pins)} of the image's packages in {seconds:.0f} s")
    build(work / "whl", python, cuda)
    env = dict(os.environ, GPU_KIT=str(work / "whl"), GPU_KIT_SITE=str(work / "kit" / "site-packages"))
    env |= {"GPU_LOGS": str(work / "logs"), "GPU_ARCHIVE": str(work / "gpu.tgz")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "rehearsal"], env=env, cwd=ROOT, check=True)
    with tarfile.open(work / "gpu.tgz") as archive:  # what a machine that returns few files would return
        print("archive:", " ".join(sorted(name for name in archive.getnames() if name.endswith((".log", ".json")))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".whl", help="the kit's folder (default .whl)")
    parser.add_argument("--python", default="3.12", help="the GPU image's Python")
    parser.add_argument("--cuda", default="130", help="the image's CUDA, as bitsandbytes names it")
    parser.add_argument("--rehearse", action="store_true", help="rehearse the GPU install here, in a fresh venv")
    parser.add_argument("--work", type=Path, help="with --rehearse: an empty folder for it (default: a temporary one)")
    parser.add_argument("--install", type=Path, help="on the GPU: install this wheelhouse into --site")
    parser.add_argument("--site", type=Path, help="with --install: a folder whose path contains site-packages")
    args = parser.parse_args()
    if args.install:
        if args.site is None or "site-packages" not in args.site.parts:
            parser.error("--install needs --site, a folder whose path contains site-packages")
        install(args.install, args.site)
    elif args.rehearse and args.work:
        rehearse(args.work, args.cuda)
    elif args.rehearse:
        with tempfile.TemporaryDirectory(prefix="gpu-kit-") as work:
            rehearse(Path(work), args.cuda)
    else:
        build(args.out, args.python, args.cuda)


if __name__ == "__main__":
    main()
