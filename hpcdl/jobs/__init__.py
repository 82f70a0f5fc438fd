"""sbatch scripts for hpcdl: site settings (TOML), templates, and a renderer.

`python -m hpcdl.jobs render train|stage|script ...` writes a job script; `python -m hpcdl.jobs
sites` lists the bundled site files. See docs/slurm.md.
"""

from hpcdl.jobs import render as _batch
from hpcdl.jobs import script_job as _script
from hpcdl.jobs.render import JobSpec
from hpcdl.jobs.site import JobSpecError, Site, bundled_sites, load_site


def render(spec: JobSpec) -> tuple[str, list[str]]:
    """The job script for any kind (train, stage: hpcdl.jobs.render; script: a user's command,
    hpcdl.jobs.script_job), and warnings for the user."""
    return (_script.render_script if spec.kind == "script" else _batch.render)(spec)


__all__ = ["JobSpec", "JobSpecError", "Site", "bundled_sites", "load_site", "render"]
