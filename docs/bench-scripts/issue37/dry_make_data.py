"""Build the dry-run comparison data sets once, at fixed paths."""
import subprocess, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
root = Path("/tmp/hh_dry/data")
from helpers import make_folder, make_tree
from hpcdl.clustermodel import calibration
from hpcdl.clustermodel.calibration import Calibration, ComputeFigures, LocalFigures, NetworkFigures, PfsFigures
CAL = Calibration(PfsFigures(0.01, 1e8), LocalFigures(1e9), NetworkFigures(1e-5, 1e-9, 1e-4, 1e-8, "hierarchical"), ComputeFigures("mlp", 8, v0=800.0, t=0.01, backward_fraction=0.5, gradient_bytes=4_000_000))
make_tree(root / "tree", 400, 1000)
make_tree(root / "big", 256, 100_000)  # 100 KB files: bandwidth, not latency, sets the pace
make_folder(root / "folder", per_class=5, size=(64, 40))
subprocess.run([sys.executable, "-m", "hpcdl.data", "convert", "digits", str(root / "digits"), "--shard-size", "400"], check=True)
calibration.save(root / "cal.toml", CAL)
(root / "job.toml").write_text(f'data = "{root}/folder"\naugment = "rrc32+flip"\nbatch_size = 2\n')
