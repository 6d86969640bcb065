# `mutmut results --all true` ("    NAME: STATUS" lines) -> one line per file of FILES: killed/total, then
# the other outcomes
BEGIN {
    FS = ": "
    n = split(files, list, " ")
    for (i = 1; i <= n; i++) { mod = list[i]; sub(/\.py$/, "", mod); gsub(/\//, ".", mod); want[mod] = list[i] }
}
{
    name = $1; sub(/^ +/, "", name); status = $2
    mod = name; sub(/\.x.*$/, "", mod)
    if (!(mod in want)) next
    total[mod]++; count[mod, status]++; seen[status] = 1
}
END {
    for (i = 1; i <= n; i++) {
        mod = list[i]; sub(/\.py$/, "", mod); gsub(/\//, ".", mod)
        line = sprintf("%s: %d/%d killed", list[i], count[mod, "killed"], total[mod])
        for (s in seen) if (s != "killed" && count[mod, s]) line = line sprintf(", %d %s", count[mod, s], s)
        print line
    }
}
