#!/bin/bash -l
#SBATCH --job-name=big
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
#SBATCH --time=48:00:00
#SBATCH --account=acct
#SBATCH --output=/home/me/run/logs/train.output
#SBATCH --dependency=afterok:77
#SBATCH --constraint=a100
#SBATCH --exclusive

# Slurm job for slurm, written by hvdrun qsub. hvdrun reads the hosts from $SLURM_JOB_NODELIST.
set -o pipefail
cd /home/me/run
export A=1
if ! /usr/bin/python3 -c 'import hvdrun' 2>/dev/null; then
  echo "hvdrun: error: the job's Python" /usr/bin/python3 "cannot import hvdrun on $(hostname): install hvdrun into that environment, or give hvdrun qsub --venv, --conda or --python" >&2
  echo 2 > /home/me/run/logs/train.exitcode
  exit 2
fi
echo "hvdrun: job big started on $(hostname) at $(date -u +%FT%TZ)"
/usr/bin/python3 -m hvdrun --ranks-per-node 1 --launcher ssh --network-interface ib0 -- train.py --epochs 3 --name 'it'"'"'s $HOME' && rc=0 || rc=$?
echo "$rc" > /home/me/run/logs/train.exitcode
echo "hvdrun: job big ended with exit code $rc at $(date -u +%FT%TZ)"
exit "$rc"
