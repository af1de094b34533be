#!/bin/bash -l
#SBATCH --job-name=train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --time=01:00:00
#SBATCH --partition=gpu
#SBATCH --account=MyProject
#SBATCH --output=/home/me/run/logs/train.output

# Slurm job for slurm, written by hvdrun qsub. hvdrun reads the hosts from $SLURM_JOB_NODELIST.
set -o pipefail
cd /home/me/run
source /home/me/venv/bin/activate
echo "hvdrun: job train started on $(hostname) at $(date -u +%FT%TZ)"
/home/me/venv/bin/python -m hvdrun --cluster slurm --ranks-per-node 4 --gpus-per-node 4 -- train.py --epochs 3 --name 'it'"'"'s $HOME' && rc=0 || rc=$?
echo "$rc" > /home/me/run/logs/train.exitcode
echo "hvdrun: job train ended with exit code $rc at $(date -u +%FT%TZ)"
exit "$rc"
