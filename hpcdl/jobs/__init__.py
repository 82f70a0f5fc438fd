"""sbatch scripts for hpcdl: site settings (TOML), templates, and a renderer.

`python -m hpcdl.jobs render train|stage ...` writes a job script; `python -m hpcdl.jobs sites`
lists the bundled site files. See docs/slurm.md.
"""

from hpcdl.jobs.render import JobSpec, render
from hpcdl.jobs.site import JobSpecError, Site, bundled_sites, load_site

__all__ = ["JobSpec", "JobSpecError", "Site", "bundled_sites", "load_site", "render"]
