#!/bin/bash
# FAKE ALCF Copper's stop_copper.sh (tests only; see launch_copper.sh here).
while getopts "d:v:" option; do
  case "$option" in d) logs=$OPTARG ;; v) mount=$OPTARG ;; *) exit 2 ;; esac
done
rm -f "$mount"
echo "fake copper: stopped $mount" | tee -a "$logs/fake-copper.log"
