from reinforce.generator.worker import main

main()
