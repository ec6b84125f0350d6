# Needed to collect coverage data
