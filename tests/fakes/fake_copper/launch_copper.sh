#!/bin/bash
# FAKE ALCF Copper (tests only): Copper itself runs only on Aurora. Like launch_copper.sh it takes -d LOG_DIR and
# -v MOUNT and exposes the file system read-through at MOUNT (MOUNT/lus/x reads /lus/x): here a symbolic link to /.
# It proves nothing about Copper; only that a job starts, routes through and stops it as ALCF's page says.
while getopts "d:v:l:" option; do
  case "$option" in d) logs=$OPTARG ;; v) mount=$OPTARG ;; l) ;; *) exit 2 ;; esac
done
mkdir -p "$logs" "$(dirname "$mount")"
ln -sfn / "$mount"
echo "fake copper: launched at $mount" | tee -a "$logs/fake-copper.log"
