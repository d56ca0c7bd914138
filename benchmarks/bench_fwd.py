"""The full benchmark grid (FlashAttention-3 sizing) and the tuning options, over the harness in
`cuflash.bench` (how it times, which peers, what each row records: see there).

  python benchmarks/bench_fwd.py --out DIR            # torch peers + cuflash -> DIR/fwd_torch.json
  python benchmarks/bench_fwd.py --out DIR --jax      # JAX cuDNN -> DIR/fwd_jax.json
  python benchmarks/bench_fwd.py --out DIR --jax --extra fp8  # and cuDNN's FP8 forward beside it
  python benchmarks/bench_fwd.py --out DIR --backward # backward rows -> DIR/bwd_torch.json
  python benchmarks/bench_fwd.py --out DIR --graph 20 # each timing a CUDA graph of 20 calls (short rows)
  python benchmarks/bench_fwd.py --out DIR --decode --graph 20 --extra fp8  # decode steps -> DIR/decode_torch.json
  python benchmarks/report.py DIR                     # -> DIR/fwd.md, DIR/bwd.md, DIR/decode.md and PNG charts
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from cuflash import bench  # noqa: E402
from cuflash.kernels import fwd_sm80, fwd_sm90  # noqa: E402


def tile_annotation(args):
    """The overridden tile row each cuflash implementation ran with, for the row's `tiles` field."""
    tables = {"cuflash": args.sm90_tiles, "cuflash-sm80": args.tiles, "cuflash-fp8": args.fp8_tiles,
              "cuflash-fp8-block": args.fp8_tiles, "cuflash-fp8-lse": args.fp8_tiles,
              "cuflash-fp8-fastexp": args.fp8_tiles}

    def annotate(impl: str, config: bench.Config) -> dict:
        table = tables.get(impl)
        return dict(tiles=str(table[config.headdim]) if table and config.headdim in table else None)
    return annotate


SM90_FIELDS = ("consumers", "block_n", "stages", "sync", "schedule")  # fwd_sm90.TILES' rows
FP8_FIELDS = SM90_FIELDS + ("v_pretransposed",)  # fwd_sm90.FP8_TILES' rows


def _tile_rows(text: str, fields: tuple[str, ...], optional: int) -> dict[int, tuple]:
    """headdim:f1 x f2 x ..., comma-separated, as table rows: three ints, the sync and the schedule
    (indices into fwd_sm90.SYNCS and SCHEDULES), then flags (0/1); the last `optional` fields may be
    left out (0)."""
    rows = {}
    for item in text.split(","):
        headdim, given = item.split(":")
        values = [int(x) for x in given.split("x")]
        if not len(fields) - optional <= len(values) <= len(fields):
            raise argparse.ArgumentTypeError(f"{item!r}: expected {' x '.join(fields)}"
                                             + (f" (the last {optional} optional)" if optional else ""))
        values += [0] * (len(fields) - len(values))
        for value, names in ((values[3], fwd_sm90.SYNCS), (values[4], fwd_sm90.SCHEDULES)):
            if not 0 <= value < len(names):
                raise argparse.ArgumentTypeError(f"{item!r}: {value} is not an index into {names}")
        rows[int(headdim)] = (*values[:3], fwd_sm90.SYNCS[values[3]], fwd_sm90.SCHEDULES[values[4]],
                              *(bool(x) for x in values[5:]))
    return rows


def sm90_tiles(text: str) -> dict[int, tuple[int, int, int, str, str]]:
    """--sm90-tiles: headdim:consumers x block_n x stages x sync [x schedule], comma-separated."""
    return _tile_rows(text, SM90_FIELDS, optional=1)


def fp8_tiles(text: str) -> dict[int, tuple[int, int, int, str, str, bool]]:
    """--fp8-tiles: headdim:consumers x block_n x stages x sync x schedule x v_pretransposed."""
    return _tile_rows(text, FP8_FIELDS, optional=0)


def _count(text: str) -> int:
    """--graph: an int >= 0 (0: eager timing)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of calls >= 0 (0 times eager calls)")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jax", action="store_true", help="run the JAX cuDNN peer (its own process)")
    parser.add_argument("--backward", action="store_true", help="time the backward pass (torch peers)")
    parser.add_argument("--decode", action="store_true", help="time decode steps (cuflash.bench.DECODE_SHAPES and "
                        "SPECULATIVE_SHAPES) instead of the FA3 grid, forward, torch peers -> DIR/decode_torch.json")
    parser.add_argument("--dtypes", default="bfloat16", type=lambda s: s.split(","))
    parser.add_argument("--headdims", default=",".join(map(str, bench.HEADDIMS)),
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--seqlens", default=",".join(map(str, bench.SEQLENS)),
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--causal", default="0,1", type=lambda s: [bool(int(x)) for x in s.split(",")])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--graph", type=_count, default=0, metavar="CALLS",
                        help="time CUDA graphs of CALLS calls each, replayed interleaved, instead of eager calls "
                        "(PyTorch only): rows of ~100 us are host-bound when timed eagerly")
    parser.add_argument("--tiles", default=None, help="fwd_sm80 tiles to time instead of the table's, "
                        "e.g. 128:128x64x4x1,64:128x128x4x2 (headdim:block_m x block_n x warps x stages)",
                        type=lambda s: {int(hd): tuple(int(x) for x in t.split("x"))
                                        for hd, t in (item.split(":") for item in s.split(","))})
    parser.add_argument("--sm90-tiles", default=None, help="fwd_sm90 tiles to time instead of the table's, "
                        "e.g. 64:3x128x2x1x0 (headdim:consumers x block_n x stages x sync x schedule: sync an "
                        "index into fwd_sm90.SYNCS, schedule into SCHEDULES, which may be left out: 0)",
                        type=sm90_tiles)
    parser.add_argument("--fp8-tiles", default=None, help="fwd_fp8_sm90 tiles to time instead of the table's, "
                        "e.g. 256:2x128x3x1x0x1 (headdim:consumers x block_n x stages x sync x schedule x "
                        "v_pretransposed)", type=fp8_tiles)
    parser.add_argument("--sm90-grid", choices=("sms", "tiles"), default="sms",
                        help="fwd_sm90's grid: one CTA per SM (persistent, the default) or one per tile")
    parser.add_argument("--extra", default=None, type=lambda s: tuple(x for x in s.split(",") if x),
                        help="cuflash variants timed beside cuflash: sm80 (forward's default), fp8 (forward), "
                        "deterministic (backward's default); an empty string for none. With --jax, fp8 adds "
                        "cuDNN's FP8 forward")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    grid = bench.configs(args.dtypes, args.headdims, args.causal, args.seqlens)
    if args.decode:
        if args.jax or args.backward:
            parser.error("--decode times the forward's decode steps against the torch peers")
        grid = bench.decode_configs(args.dtypes)
    if args.jax and args.graph:
        parser.error("--graph times the torch process's implementations; --jax times JAX's peers in programs of "
                     "back-to-back calls")
    if args.jax:
        rows = bench.run_jax(grid, args.reps, fp8="fp8" in (args.extra or ()))
    else:
        fwd_sm80.tiles_override = args.tiles  # time other rows of the tile tables
        fwd_sm90.tiles_override = args.sm90_tiles
        fwd_sm90.fp8_tiles_override = args.fp8_tiles
        fwd_sm90.persistent = args.sm90_grid == "sms"
        xp = bench.array_backend()
        if args.graph and xp.name != "torch":
            parser.error("--graph needs PyTorch with CUDA (it captures with torch.cuda.graph)")
        print(f"host time per cuflash.attention call (tiny problem): {bench.host_overhead_us(xp):.1f} us", flush=True)
        rows = bench.run(grid, backward=args.backward, reps=args.reps, warmup=args.warmup, xp=xp,
                         extra=args.extra if args.extra is not None else ("deterministic",) if args.backward else ("sm80",),
                         annotate=tile_annotation(args), graph_calls=args.graph)
    name = ("fwd_jax.json" if args.jax else "bwd_torch.json" if args.backward
            else "decode_torch.json" if args.decode else "fwd_torch.json")
    bench.save(args.out / name, rows, reps=args.reps, command=" ".join(sys.argv), graph_calls=args.graph)
    return 0


if __name__ == "__main__":
    sys.exit(main())
