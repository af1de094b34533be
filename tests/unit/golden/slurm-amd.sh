#!/bin/bash -l
#SBATCH --job-name=train
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=02:00:00
#SBATCH --account=MyProject
#SBATCH --output=/home/me/run/logs/train.output

# Slurm job for slurm-amd, written by hvdrun qsub. hvdrun reads the hosts from $SLURM_JOB_NODELIST.
set -o pipefail
cd /home/me/run
if ! /home/me/venv/bin/python -c 'import hvdrun' 2>/dev/null; then
  echo "hvdrun: error: the job's Python" /home/me/venv/bin/python "cannot import hvdrun on $(hostname): install hvdrun into that environment, or give hvdrun qsub --venv, --conda or --python" >&2
  echo 2 > /home/me/run/logs/train.exitcode
  exit 2
fi
echo "hvdrun: job train started on $(hostname) at $(date -u +%FT%TZ)"
/home/me/venv/bin/python -m hvdrun --cluster slurm-amd --ranks-per-node 8 -- train.py --epochs 3 --name 'it'"'"'s $HOME' && rc=0 || rc=$?
echo "$rc" > /home/me/run/logs/train.exitcode
echo "hvdrun: job train ended with exit code $rc at $(date -u +%FT%TZ)"
exit "$rc"
