module github.com/openlora/openlora-otel/tools/cortex

// Pins Cortex for tools/build.sh. Its go.mod has replace directives, which `go install` and a
// requiring module both ignore, so the build runs inside a copy of this module's download.
go 1.26.8

require github.com/cortexproject/cortex v1.21.1
