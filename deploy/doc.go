// Package deploy holds what operators load beside idemq: Prometheus alerting rules
// (prometheus/rules.yml, with promtool unit tests in prometheus/rules_test.yml) and a
// Grafana dashboard (grafana/idemq.json). It has no Go code; its tests check the files
// with promtool and against the metrics idemq exports.
package deploy
