#!/bin/bash -l
#PBS -A MyProject
#PBS -q debug-scaling
#PBS -l select=2:system=aurora
#PBS -l place=scatter
#PBS -l walltime=00:50:00
#PBS -l filesystems=flare
#PBS -N train
#PBS -k doe
#PBS -o /home/me/run/logs/train.output
#PBS -j oe

# PBS Pro job for aurora, written by hvdrun qsub. hvdrun reads the hosts from $PBS_NODEFILE.
set -o pipefail
cd /home/me/run
module load frameworks
echo "hvdrun: job train started on $(hostname) at $(date -u +%FT%TZ)"
python -m hvdrun --cluster aurora --ranks-per-node 12 -- train.py --epochs 3 --name 'it'"'"'s $HOME' && rc=0 || rc=$?
echo "$rc" > /home/me/run/logs/train.exitcode
echo "hvdrun: job train ended with exit code $rc at $(date -u +%FT%TZ)"
exit "$rc"
